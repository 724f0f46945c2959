"""The event catalog: versioned msgspec messages and the subjects they travel on."""
