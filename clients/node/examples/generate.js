// node examples/generate.js HOST:PORT PROBE: stream text, probe scores and layer-3 activations.
const { EngineClient, decodeBatch } = require('../src');

async function main([target = '127.0.0.1:50051', probe = 'residual_norm'] = process.argv.slice(2)) {
  const engine = new EngineClient(target);  // options: { rootCert, clientCert, clientKey, token, maxMessageBytes, deadlineMs }
  const rows = [];
  for await (const event of engine.generate({
    text: 'The quick brown fox', sampling: { maxTokens: 12, temperature: 0 }, probes: [{ probe }],
    extractionPoints: [{ name: 'r3', tensorType: 'TENSOR_TYPE_RESIDUAL_STREAM', layers: [3], streamToClient: true }],
  })) {
    if (event.type === 'tokens') process.stdout.write(event.text);
    else if (event.type === 'probeScores') process.stdout.write(` [${event.probe} ${event.scores.map((s) => s.toFixed(1))}] `);
    else if (event.type === 'activations') rows.push(...decodeBatch(event.batch));  // Float32Array rows
    else if (event.type === 'finished') console.log(`\nfinished: ${event.reason}; ${rows.length} rows of ${rows[0].values.length} floats`);
  }
  engine.close();
}
main().catch((err) => { console.error(`error: ${err.message}`); process.exit(1); });
