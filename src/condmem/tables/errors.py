"""`StorageError`: a table that cannot be placed in, or read from, its tier. The tiers
(`storage`) and the row readers they use (`direct_read`, `released`) raise it."""


class StorageError(ValueError):
    """A table cannot be placed in the requested tier, or a row cannot be read from it."""
