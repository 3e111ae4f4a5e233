"""The ``imq`` command: thin wrappers that parse, call the facade and print."""
