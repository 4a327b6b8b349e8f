"""The table: rows and keys, one index, the store, exchange documents and device fingerprints.
It stores; it does not decide."""
