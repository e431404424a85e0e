"""The one way benchmarks get matplotlib: headless (Agg), or None with a message when it is not installed
(plots are optional; the JSON results are what counts)."""


def pyplot():
    """``matplotlib.pyplot`` set up for writing files, or None (after saying so) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_axes(ax, xlabel: str) -> None:
    """Decode tokens/s against a log2 ``xlabel`` axis (batch, prefix, sequences), with the legend."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("decode tokens/s")
    ax.legend()


def save(fig, path) -> None:
    """Lay the figure out, write it and say where."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
