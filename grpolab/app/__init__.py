"""The command line, the commands behind it and the Python API."""
