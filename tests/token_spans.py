"""Runs of equal values in a token mask: the sampled (1) and given (0) spans of a trace."""


def spans(mask):
    """[(value, start, end)] runs of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out
