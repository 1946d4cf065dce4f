"""One-off diagnoses: the scripts that explained a measured result, kept with their notes so that the
numbers the notes quote can be re-run. Not benchmarks: nothing here is a figure the docs rely on
without a note next to it."""
