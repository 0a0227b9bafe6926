"""Built-in example jobs that the runtime can train without user code."""
