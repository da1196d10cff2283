// node examples/generate.js HOST:PORT PROBE: stream text, probe scores and layer-3 activations.
const { EngineClient, decodeBatch } = require('../src');

async function main([target = '127.0.0.1:50051', probe = 'residual_norm'] = process.argv.slice(2)) {
  const engine = new EngineClient(target);
  const request = { text: 'The quick brown fox', sampling: { maxTokens: 12, temperature: 0 }, probes: [{ probe }],
    extractionPoints: [{ name: 'r3', tensorType: 'TENSOR_TYPE_RESIDUAL_STREAM', layers: [3], streamToClient: true }] };
  for await (const event of engine.generate(request)) {
    if (event.type === 'tokens') process.stdout.write(event.text);
    else if (event.type === 'probeScores') console.log(`\n  [${event.probe}]`, event.scores.map((s) => s.toFixed(2)).join(' '));
    else if (event.type === 'activations') for (const row of decodeBatch(event.batch)) console.log(`  ${row.point}@${row.layer} position ${row.tokenPosition}: ${row.values.length} x ${row.dtype}, first ${row.values[0].toFixed(4)}`);
    else if (event.type === 'finished') console.log(`\nfinished: ${event.reason}, ${event.generatedTokens} tokens`);
  }
  engine.close();
}
main().catch((err) => { console.error(`error: ${err.message}`); process.exit(1); });
