"""The draft service: proposes candidate trees with a small LM or an EAGLE head."""
