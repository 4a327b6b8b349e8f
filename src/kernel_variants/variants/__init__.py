"""Built-in variants. Each module is a plugin registered through the same hook as third parties."""
