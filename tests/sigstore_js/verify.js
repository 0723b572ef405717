// Verify a DVBench certificate bundle with Sigstore's JavaScript verifier (the one npm
// uses), with its default policy: at least one verified timestamp and one verified
// transparency-log entry. Nothing of DVBench's is used; the only glue is the key lookup
// below, which Sigstore leaves to the caller for bundles signed with a bare public key.
//
//   node verify.js BUNDLE.sigstore.json trusted_root.json
//
// Exit 0 and "verified" on success; exit 1 and "<CODE>: <message>" otherwise.
'use strict';

const crypto = require('crypto');
const fs = require('fs');
const { bundleFromJSON } = require('@sigstore/bundle');
const { TrustedRoot } = require('@sigstore/protobuf-specs');
const { Verifier, toSignedEntity, toTrustMaterial } = require('@sigstore/verify');

// The platform's key signs the certificates and the log, so the trusted root lists it
// as the log's key, with its validity window. A bundle names it by its key id, the one
// securesystemslib computes (SHA-256 of the key's canonical JSON): index the log keys
// by that id, and by the SHA-256 of the SubjectPublicKeyInfo (older certificates' id).
function keysOf(root) {
  const keys = {};
  for (const tlog of root.tlogs) {
    const der = Buffer.from(tlog.publicKey.rawBytes);
    const raw = der.subarray(der.length - 32);
    const sslib = `{"keytype":"ed25519","keyval":{"public":"${raw.toString('hex')}"},"scheme":"ed25519"}`;
    const ids = [
      crypto.createHash('sha256').update(sslib).digest('hex'),
      crypto.createHash('sha256').update(der).digest('hex'),
    ];
    for (const id of ids) keys[id] = tlog.publicKey;
  }
  return keys;
}

function main(argv) {
  if (argv.length !== 2) {
    process.stderr.write('usage: node verify.js BUNDLE.sigstore.json trusted_root.json\n');
    return 2;
  }
  try {
    const bundle = bundleFromJSON(JSON.parse(fs.readFileSync(argv[0], 'utf8')));
    const root = TrustedRoot.fromJSON(JSON.parse(fs.readFileSync(argv[1], 'utf8')));
    const verifier = new Verifier(toTrustMaterial(root, keysOf(root)));
    verifier.verify(toSignedEntity(bundle));
  } catch (error) {
    process.stdout.write(`${error.code || error.name}: ${error.message}\n`);
    return 1;
  }
  process.stdout.write('verified\n');
  return 0;
}

process.exitCode = main(process.argv.slice(2));
