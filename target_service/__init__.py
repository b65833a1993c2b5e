"""The target service: the front door; owns the target model and drives every round."""
