#!/usr/bin/env bash
# Rebuild the web pages' bundle (src/strata/web/static, committed) from web/: installs the exact packages of
# web/package-lock.json, then builds with Vite. Needs Node.js and npm; users of the package never do.
set -euo pipefail
cd "$(dirname "$0")/../web"
npm ci --no-audit --no-fund
npm run build
