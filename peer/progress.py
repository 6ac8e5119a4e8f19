"""The timing at the end of every progress line (train-local, a swarm peer's, simulate): time elapsed and time left.

>>> elapsed_and_eta(12.0, done=20, total=120)  # '12s, ETA 1m00s': the mean pace so far, over the steps left
>>> format_duration(3725)  # '1h02m'
"""


def format_duration(seconds: float) -> str:
    """``seconds`` rounded, in the two largest units: 7s, 1m05s, 2h03m."""
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def elapsed_and_eta(elapsed_s: float, *, done: float, total: float) -> str:
    """The time elapsed and, while ``0 < done < total``, the time left at the mean pace so far (``done`` of ``total``
    steps, tokens, …, in ``elapsed_s``): "12s, ETA 1m00s"; the elapsed time alone otherwise."""
    if not 0 < done < total:
        return format_duration(elapsed_s)
    return f"{format_duration(elapsed_s)}, ETA {format_duration(elapsed_s * (total - done) / done)}"
