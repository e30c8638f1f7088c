"""Pictures: the `strata-vision` encoder process (worker, encoder, mmproj files) and its line protocol."""
