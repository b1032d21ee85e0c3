"""The commands' work, one function each, so that cli.py only parses and prints."""
