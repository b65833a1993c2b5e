"""Plain-torch model code: the Llama decoder, the EAGLE head, checkpoint loading."""
