"""Pictures on the server's side: where they come from (data: URLs, base64, downloads under a policy), their
rows and the cache of encoded ones. The encoder itself is `strata.vision`."""
