"""Developer tools that read the package (not used at run time)."""
