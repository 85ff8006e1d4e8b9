"""Events, and what is read back from them."""
