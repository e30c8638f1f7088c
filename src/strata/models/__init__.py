"""Model files shipped with Strata: the trained demo model (`demo.gguf`) and its vision encoder
(`demo-mmproj.gguf`). `docs/DEMO_MODEL.md` describes them; `python -m strata.modelgen.demo.train` rebuilds them."""
