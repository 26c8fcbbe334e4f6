"""The ending of the quality tests' Python checks."""


def verdict(fails):
    """Prints FAIL and each failure, or PASS; returns the exit status (1 or 0)."""
    if fails:
        print("FAIL\n  " + "\n  ".join(fails))
        return 1
    print("PASS")
    return 0
