"""The measurement core: load once, tokenize and measure once. Rules read these through public names."""
