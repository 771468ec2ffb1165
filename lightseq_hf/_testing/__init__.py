"""Private hooks for the test suite and benchmarks: fault injection and kernel knobs.

Nothing here is public API. The library never reads an environment variable for these; tests and
benchmarks set them through the functions in this package.
"""
