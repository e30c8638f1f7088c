"""Pictures on the server's side: where they come from (`sources`: data: URLs, base64, downloads under the policy
of `downloads`), a request's pictures staged and encoded (`staging`), the cache of encoded ones (`cache`), their
rows in the prompt (`expand`, `rows`). The encoder itself is `strata.vision`."""
