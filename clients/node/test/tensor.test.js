'use strict';
// Decoding of each wire dtype, on bytes built here by hand (no services needed).
const test = require('node:test');
const assert = require('node:assert/strict');
const { decodeBatch, decodeTensor, halfToFloat } = require('../src/tensor');

/** @param {number[]} words 16-bit values, little-endian */
const u16 = (words) => {
  const buf = Buffer.alloc(words.length * 2);
  words.forEach((w, i) => buf.writeUInt16LE(w, 2 * i));
  return buf;
};

test('float32 rows decode little-endian and row-major', () => {
  const data = Buffer.alloc(24);
  [1.5, -2.25, 3, 0.1, 1e30, -0].forEach((v, i) => data.writeFloatLE(v, 4 * i));
  const { shape, values } = decodeTensor({ dtype: 'float32', shape: [2, 3], data });
  assert.deepEqual(shape, [2, 3]);
  assert.deepEqual(Array.from(values), [1.5, -2.25, 3, Math.fround(0.1), Math.fround(1e30), -0]);
});

test('float16 covers normals, subnormals, infinities and NaN', () => {
  const { values } = decodeTensor({
    dtype: 'float16', shape: [7], data: u16([0x3c00, 0xc000, 0x7bff, 0x0001, 0x8400, 0x7c00, 0x7e00]),
  });
  assert.deepEqual(Array.from(values.slice(0, 6)), [1, -2, 65504, 2 ** -24, -(2 ** -14), Infinity]);
  assert.ok(Number.isNaN(values[6]));
  assert.equal(halfToFloat(0x3555), Math.fround(0.333251953125));
});

test('bfloat16 is the top half of a float32', () => {
  const { values } = decodeTensor({ dtype: 'bfloat16', shape: [1, 4], data: u16([0x3f80, 0xc0a0, 0x3dcd, 0xff80]) });
  assert.deepEqual(Array.from(values), [1, -5, 0.10009765625, -Infinity]);
});

test('bad tensors are refused naming the problem', () => {
  assert.throws(() => decodeTensor({ dtype: 'int8', shape: [1], data: Buffer.alloc(1) }), /tensor.dtype "int8" is not supported/);
  assert.throws(() => decodeTensor({ dtype: 'float32', shape: [2, 2], data: Buffer.alloc(15) }), /tensor.data has 15 bytes but shape \[2,2\] of float32 needs 16/);
  assert.throws(() => decodeTensor({ dtype: 'float16', shape: [-1], data: Buffer.alloc(0) }), /negative/);
});

test('a batch decodes to keyed rows; a bad index names the block and field', () => {
  const data = Buffer.alloc(16);
  [1, 2, 3, 4].forEach((v, i) => data.writeFloatLE(v, 4 * i));
  const block = {
    point: 'p', layer: 3, rows: { dtype: 'float32', shape: [2, 2], data },
    requestIndex: [1, 0], tokenPositions: [7, 2], isGenerated: [true, false],
  };
  const rows = decodeBatch({ requestIds: ['a', 'b'], blocks: [block] });
  assert.deepEqual(rows.map((r) => [r.requestId, r.point, r.layer, r.tokenPosition, r.isGenerated, Array.from(r.values)]),
    [['b', 'p', 3, 7, true, [1, 2]], ['a', 'p', 3, 2, false, [3, 4]]]);
  assert.throws(() => decodeBatch({ requestIds: ['a'], blocks: [block] }), /blocks\[0\] \(p@3\)\.requestIndex: index out of range/);
  assert.throws(() => decodeBatch({ requestIds: ['a', 'b'], blocks: [{ ...block, tokenPositions: [1] }] }), /tokenPositions: 1 entries for 2 rows/);
});
