"""`unbroken run`'s flags, declared once: each is a field of a typed group (`groups.py`) that
carries its spellings, help, `PET_` variable and value parser (`declare.py`); the parser is
generated from the groups (`parser.py`), and `resolve.py` turns the parsed groups into the
`LaunchConfig`. Kept free of imports so that `launch.config` can import the groups."""
