"""Save: capture each optimizer leaf as torch would and emit the sparse dict."""
