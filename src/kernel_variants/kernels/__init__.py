"""The built-in implementations (variants) of the ops, one plugin module per provider family."""
