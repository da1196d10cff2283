'use strict';
// Against a real engine and router. tests/e2e/test_clients.py starts them, loads a
// probe that fires at a known token, captures the same request's activations with
// the Python client, writes the fixture, and runs this file with the variables
// below. tests/processes/test_half_precision.py runs the capture test alone
// against bfloat16 and float16 engines without a router.
//   UNDERCURRENT_ENGINE, UNDERCURRENT_ROUTER  host:port of the services (the router
//                                             only for the tests that use it)
//   UNDERCURRENT_NODE_FIXTURE                 the fixture JSON
//   UNDERCURRENT_TLS_CA                       CA of the services' certificates (TLS when set)
//   UNDERCURRENT_TLS_CERT, UNDERCURRENT_TLS_KEY  client certificate (the router requires one)
//   UNDERCURRENT_TOKEN, UNDERCURRENT_ADMIN_TOKEN  client token (engine), admin token (router)
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const { EngineClient, ProbeAdminClient, RpcError, decodeBatch, packageDefinition, rowKey } = require('../src');

const { UNDERCURRENT_ENGINE: ENGINE, UNDERCURRENT_ROUTER: ROUTER, UNDERCURRENT_NODE_FIXTURE: FIXTURE } = process.env;
const skip = ENGINE && FIXTURE ? false : 'set UNDERCURRENT_ENGINE and UNDERCURRENT_NODE_FIXTURE';
const skipRouted = skip || (ROUTER ? false : 'set UNDERCURRENT_ROUTER');
const fixture = skip ? null : JSON.parse(fs.readFileSync(FIXTURE, 'utf8'));
const { UNDERCURRENT_TLS_CA: CA, UNDERCURRENT_TLS_CERT: CERT, UNDERCURRENT_TLS_KEY: KEY } = process.env;
const tls = CA ? { rootCert: CA } : {};
const engineOptions = { ...tls, token: process.env.UNDERCURRENT_TOKEN };
const adminOptions = { ...tls, ...(CA && CERT ? { clientCert: CERT, clientKey: KEY } : {}), token: process.env.UNDERCURRENT_ADMIN_TOKEN };

/** Every event of one Generate stream, gathered. */
async function run(engine, request) {
  const out = { tokens: [], batches: [], scores: [], started: null, finished: null };
  for await (const event of engine.generate(request)) {
    if (event.type === 'started') out.started = event;
    else if (event.type === 'tokens') {
      assert.equal(event.firstIndex, out.tokens.length);
      out.tokens.push(...event.tokenIds);
    } else if (event.type === 'activations') out.batches.push(event.batch);
    else if (event.type === 'probeScores') out.scores.push(event);
    else if (event.type === 'finished') out.finished = event;
  }
  assert.ok(out.started && out.finished, 'stream without started or finished');
  return out;
}

/** Rows keyed by point|layer|position (the request id differs between the two clients). */
function byPosition(rows) {
  return new Map(rows.map((r) => [`${r.point}|${r.layer}|${r.tokenPosition}`, r]));
}

test('model info describes the embedded model', { skip }, async () => {
  const engine = new EngineClient(ENGINE, engineOptions);
  const info = await engine.modelInfo();
  engine.close();
  assert.equal(info.architecture, 'LlamaForCausalLM');
  assert.deepEqual([info.numLayers, info.hiddenSize, info.dtype], [4, 128, 'float32']);
  assert.deepEqual(info.ranks.map((r) => [r.startLayer, r.endLayer]), [[0, 4]]);
});

test('a gated Generate with the probe aborts at its known token', { skip: skipRouted }, async () => {
  const engine = new EngineClient(ENGINE, engineOptions);
  const { probe, prompt, maxTokens, baselineTokens } = fixture.abort;
  const out = await run(engine, {
    requestId: 'node-abort', text: prompt, gateTokens: true,
    sampling: { maxTokens, temperature: 0, ignoreEos: true },
    probes: [{ probe: probe.name, failurePolicy: 'FAILURE_POLICY_FAIL_CLOSED' }],
  });
  engine.close();
  assert.equal(out.finished.reason, 'PROBE_ABORT');
  assert.equal(out.finished.verdict.probe, probe.name);
  assert.equal(out.finished.verdict.tokenPosition, probe.position);
  assert.ok(out.finished.verdict.score >= probe.threshold);
  assert.equal(out.finished.verdict.router, ROUTER);
  const trigger = probe.position - out.started.promptTokens;
  // Gated: every token before the trigger, none at or after it, as the baseline made them.
  assert.deepEqual(out.tokens, baselineTokens.slice(0, trigger));
  assert.ok(out.finished.generatedTokens > trigger);
});

test('live activations decode to the values the Python client decoded', { skip }, async () => {
  const engine = new EngineClient(ENGINE, engineOptions);
  const out = await run(engine, { ...fixture.capture.request, requestId: 'node-capture' });
  engine.close();
  assert.equal(out.finished.reason, 'LENGTH');
  const rows = out.batches.flatMap(decodeBatch);
  const expected = fixture.capture.rows;
  assert.equal(rows.length, expected.length);
  const mine = byPosition(rows);
  for (const want of expected) {
    const got = mine.get(`${want.point}|${want.layer}|${want.tokenPosition}`);
    assert.ok(got, `missing row ${want.point}@${want.layer} position ${want.tokenPosition}`);
    assert.equal(got.requestId, 'node-capture');
    assert.equal(got.isGenerated, want.isGenerated);
    assert.equal(got.dtype, want.dtype); // as served: the model's dtype
    assert.deepEqual(Array.from(got.values), want.values);
  }
});

test('float32, float16 and bfloat16 batches decode exactly as in Python', { skip }, () => {
  const { responseDeserialize } = packageDefinition['undercurrent.v1.EngineService'].Generate;
  const seen = new Set();
  for (const encoded of fixture.encoded) {
    const response = responseDeserialize(Buffer.from(encoded.response, 'base64'));
    const rows = decodeBatch(response.activations);
    assert.deepEqual(rows.map(rowKey), encoded.rows.map(rowKey));
    rows.forEach((row, i) => {
      assert.equal(row.dtype, encoded.dtype);
      // Python wrote each float32 as a JSON number; equal bit for bit.
      assert.deepEqual(Array.from(row.values), encoded.rows[i].values);
    });
    seen.add(encoded.dtype);
  }
  assert.deepEqual([...seen].sort(), ['bfloat16', 'float16', 'float32']);
});

test('ProbeAdmin loads, lists and unloads a probe', { skip: skipRouted }, async () => {
  const admin = new ProbeAdminClient(ROUTER, adminOptions);
  const { manifestJson, name } = fixture.admin;
  const loaded = await admin.load({ manifestJson });
  assert.deepEqual([loaded.name, loaded.kind, loaded.action], [name, 'PROBE_KIND_NORM', 'PROBE_ACTION_OBSERVE']);
  await assert.rejects(admin.load({ manifestJson }), (err) => err instanceof RpcError && err.code === 'ALREADY_EXISTS');
  const names = (await admin.list()).map((p) => p.name);
  assert.ok(names.includes(name) && names.includes(fixture.abort.probe.name), names.join(','));
  assert.equal(await admin.unload(name), true);
  assert.ok(!(await admin.list()).some((p) => p.name === name));
  await assert.rejects(admin.unload(name), (err) => err instanceof RpcError && err.code === 'NOT_FOUND' && err.details.includes(name));
  admin.close();
});
