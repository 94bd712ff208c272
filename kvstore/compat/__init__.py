"""Other stores' APIs over kvstore, for users who bring code written for them (mooncake)."""
