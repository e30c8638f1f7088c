// Builds the pages into the Python package (src/strata/web/static), with build.json: the fingerprint of the
// sources it was built from (checked by the test suite against the sources in the repository) and each output
// file's sha256.
import { createHash } from "node:crypto";
import { readdirSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { join, relative, sep } from "node:path";
import { fileURLToPath } from "node:url";
import { defineConfig } from "vite";

const root = fileURLToPath(new URL(".", import.meta.url));
const outDir = join(root, "..", "src", "strata", "web", "static");
const sha256 = (data) => createHash("sha256").update(data).digest("hex");

function files(dir, skip) {
  return readdirSync(dir).flatMap((name) => {
    const path = join(dir, name);
    if (skip.includes(name)) return [];
    return statSync(path).isDirectory() ? files(path, skip) : [path];
  });
}

// The same computation as strata.web.sources_fingerprint.
function sourcesFingerprint() {
  const names = files(root, ["node_modules"]).map((path) => relative(root, path).split(sep).join("/")).sort();
  const digest = createHash("sha256");
  for (const name of names) digest.update(`${name}\0${sha256(readFileSync(join(root, name)))}\n`);
  return digest.digest("hex");
}

const buildInfo = {
  name: "strata-build-info",
  apply: "build",
  closeBundle() {
    const built = {};
    for (const path of files(outDir, ["build.json"]).sort()) {
      built[relative(outDir, path).split(sep).join("/")] = sha256(readFileSync(path));
    }
    const info = { sources: sourcesFingerprint(), files: built };
    writeFileSync(join(outDir, "build.json"), JSON.stringify(info, null, 2) + "\n");
  },
};

export default defineConfig({
  root,
  base: "/",
  plugins: [buildInfo],
  build: { outDir, emptyOutDir: true, assetsDir: "assets", sourcemap: false, chunkSizeWarningLimit: 2000 },
});
