"""Small helpers shared by the layers."""


def check_positive_int(name: str, value: object) -> None:
    """Raise a `ValueError` naming `name` unless `value` is an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
