"""Tools around training: benchmark, plot, sweep, the run summary, the PyTorch reference."""
