"""`purepp run` and `purepp check`: a toy PP x DP decode loop with purepp inside, checked
token for token against a single-stage run (`cli.launch` runs it from Python)."""
