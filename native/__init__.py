"""native: the C floor of duck (fp9 codec, kernels, worker pool) and its thin
Python binding. Imports nothing of the project."""
