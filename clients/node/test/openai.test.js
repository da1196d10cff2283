'use strict';
// The engine's OpenAI-compatible API through the official `openai` npm package,
// against a real engine and router. tests/e2e/test_openai_api.py starts them
// (the caller `other` has an operator-set guard that fires at generated index
// minTokens - 1) and runs this file with the variables below
// (tests/e2e/node_live.py, run_openai).
//   UNDERCURRENT_OPENAI_URL        the API's base URL (https://host:port/v1)
//   NODE_EXTRA_CA_CERTS            the CA of the engine's certificate
//   UNDERCURRENT_TOKEN             the `demo` caller's token
//   UNDERCURRENT_OTHER_TOKEN       the `other` caller's token
//   UNDERCURRENT_OPENAI_FIXTURE    JSON: {model, guard, minTokens}
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const OpenAI = require('openai');

const { UNDERCURRENT_OPENAI_URL: URL, UNDERCURRENT_OPENAI_FIXTURE: FIXTURE } = process.env;
const skip = URL && FIXTURE ? false : 'set UNDERCURRENT_OPENAI_URL and UNDERCURRENT_OPENAI_FIXTURE';
const fixture = skip ? null : JSON.parse(fs.readFileSync(FIXTURE, 'utf8'));
const client = (token) => new OpenAI({ baseURL: URL, apiKey: token, maxRetries: 0 });
const messages = [{ role: 'user', content: 'The quick brown fox' }];

test('OpenAI: a streamed chat bound to the guard ends content_filter with the verdict, no token past it',
  { skip }, async () => {
    const demo = client(process.env.UNDERCURRENT_TOKEN);
    const stream = await demo.chat.completions.create({
      model: fixture.model, messages, max_tokens: 40, temperature: 0, stream: true,
      stream_options: { include_usage: true }, ignore_eos: true,
      undercurrent: { probes: [{ probe: fixture.guard, failure_policy: 'fail_closed' }], gate_tokens: true },
    });
    const chunks = [];
    for await (const chunk of stream) chunks.push(chunk);
    const last = chunks.filter((c) => c.choices.length).at(-1);
    assert.equal(last.choices[0].finish_reason, 'content_filter');
    const { verdict, gated, finish_reason: reason } = last.undercurrent;
    assert.deepEqual([verdict.probe, verdict.generated_index, gated, reason],
      [fixture.guard, fixture.minTokens - 1, true, 'PROBE_ABORT']);
    const usage = chunks.at(-1).usage;
    assert.equal(usage.completion_tokens, fixture.minTokens - 1);
    assert.equal(verdict.token_position, usage.prompt_tokens + fixture.minTokens - 1);
  });

test('OpenAI: the operator guard holds on a request naming none, and weakening it is a 400 naming the field',
  { skip }, async () => {
    const other = client(process.env.UNDERCURRENT_OTHER_TOKEN);
    const answer = await other.completions.create({
      model: fixture.model, prompt: 'Once upon a time', max_tokens: 40, temperature: 0, ignore_eos: true,
    });
    assert.equal(answer.choices[0].finish_reason, 'content_filter');
    const guard = answer.undercurrent.bindings.find((b) => b.probe === fixture.guard);
    assert.deepEqual([guard.operator_set, guard.failure_policy, answer.undercurrent.gated], [true, 'fail_closed', true]);
    await assert.rejects(
      other.completions.create({
        model: fixture.model, prompt: 'hi', max_tokens: 4,
        undercurrent: { probes: [{ probe: fixture.guard, failure_policy: 'fail_open' }] },
      }),
      (err) => err instanceof OpenAI.BadRequestError && err.status === 400
        && err.param === 'undercurrent.probes[0].failure_policy' && /would weaken/.test(err.message));
  });

test('OpenAI: a wrong token is a 401', { skip }, async () => {
  await assert.rejects(client('not-a-token-of-this-engine').models.list(),
    (err) => err instanceof OpenAI.AuthenticationError && err.status === 401);
});
