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
