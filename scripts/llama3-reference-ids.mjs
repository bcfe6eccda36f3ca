// Writes tests/data/llama3_reference.json: the token ids of the independent JS tokenizer
// `llama3-tokenizer-js` 1.2.0 (npm) on its own test cases and on three text files, the reference
// for qcal's tokenizer.json implementation (tests/common/hf_tokenizer_test.cc, issue 12).
//
// Usage:  node scripts/llama3-reference-ids.mjs [--bench]     (from the repository root)
//
// The package is fetched with `npm pack` into a temporary directory (nothing is added to the
// repository). Its own test cases are recorded by running its `defaultTests` against a proxy that
// forwards to the real tokenizer and records every call, so the inputs are the package's, not a
// copy. For each file the ids (no BOS/EOS) are summarized as a count and an FNV-1a 64 hash of the
// ids as little-endian int32 bytes (the same hash the C++ test computes). --bench times the
// single-threaded encoding of the WikiText-2 test file (best of 5) for bench/tokenizer_bench.sh.
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync, rmSync, mkdirSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';

const PACKAGE = 'llama3-tokenizer-js';
const VERSION = '1.2.0';
const root = resolve(process.cwd());
const shared = process.env.QCAL_SHARED_DIR ?? resolve(root, '..', 'shared');
const FILES = [
  'data/wikitext2/wiki.test.joined.txt',
  'data/ptb/ptb.valid.txt',
  'data/tinystories/TinyStories-valid.sample30k.txt',
];

const work = mkdtempSync(join(tmpdir(), 'llama3-js-'));
try {
  execFileSync('npm', ['pack', `${PACKAGE}@${VERSION}`, '--silent'], { cwd: work, stdio: ['ignore', 'pipe', 'inherit'] });
  execFileSync('tar', ['xzf', `${PACKAGE}-${VERSION}.tgz`], { cwd: work });
  const bundle = join(work, 'package', 'bundle', 'llama3-tokenizer-with-baked-data.js');
  const { default: tokenizer } = await import(pathToFileURL(bundle).href);

  if (process.argv.includes('--bench')) {
    const file = process.env.QCAL_BENCH_FILE ?? join(shared, FILES[0]);
    const text = readFileSync(file, 'utf8');
    let best = Infinity;
    let count = 0;
    for (let i = 0; i < 5; ++i) {
      const t0 = performance.now();
      count = tokenizer.encode(text, { bos: false, eos: false }).length;
      best = Math.min(best, performance.now() - t0);
    }
    console.log(JSON.stringify({ file, bytes: Buffer.byteLength(text), tokens: count, best_ms: best }));
    process.exit(0);
  }

  const cases = [];
  const proxy = {
    encode(input, options) {
      const ids = tokenizer.encode(input, options);
      const o = options ?? { bos: true, eos: true };
      cases.push({ kind: 'encode', input, bos: !!o.bos, eos: !!o.eos, ids });
      return ids;
    },
    decode(ids) {
      const text = tokenizer.decode(ids);
      cases.push({ kind: 'decode', ids, text });
      return text;
    },
    // optimisticCount maps look-alike special tokens to a fallback id: not a tokenizer.json
    // behaviour, so it is forwarded and not recorded.
    optimisticCount(input) { return tokenizer.optimisticCount(input); },
  };
  const log = console.log;
  console.log = () => {};
  tokenizer.defaultTests(proxy);
  console.log = log;

  const files = [];
  for (const path of FILES) {
    const text = readFileSync(join(shared, path), 'utf8');
    const ids = tokenizer.encode(text, { bos: false, eos: false });
    let h = 0xcbf29ce484222325n;
    const prime = 0x100000001b3n;
    const mask = 0xffffffffffffffffn;
    for (const id of ids) {
      for (let k = 0; k < 4; ++k) {
        h ^= BigInt((id >>> (8 * k)) & 0xff);
        h = (h * prime) & mask;
      }
    }
    files.push({ path, tokens: ids.length, fnv1a64: h.toString(16).padStart(16, '0'), first_ids: ids.slice(0, 64) });
  }
  mkdirSync(join(root, 'tests', 'data'), { recursive: true });
  const out = {
    generator: 'scripts/llama3-reference-ids.mjs',
    package: `${PACKAGE}@${VERSION}`,
    note: 'ids without BOS/EOS unless a case says so; fnv1a64 over the ids as little-endian int32',
    cases,
    files,
  };
  writeFileSync(join(root, 'tests', 'data', 'llama3_reference.json'), JSON.stringify(out, null, 1) + '\n');
  console.log(`wrote tests/data/llama3_reference.json: ${cases.length} cases, ${files.map(f => `${f.path} ${f.tokens} tokens`).join(', ')}`);
} finally {
  rmSync(work, { recursive: true, force: true });
}
