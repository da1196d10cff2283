// @ts-check
'use strict';
/**
 * Tensor and ActivationBatch decoding, as the contract defines it on `Tensor`
 * (proto/undercurrent/v1/types.proto): raw little-endian bytes in
 * row-major order; bfloat16 is the top 16 bits of a float32. Every dtype
 * decodes to float32, as the Python decoder (common/tensor_codec.py) does.
 */

/** Element size in bytes of each wire dtype. */
const ITEM_SIZE = Object.freeze({ float32: 4, float16: 2, bfloat16: 2, float64: 8 });

/**
 * @typedef {{dtype: string, shape: Array<number|string>, data: Uint8Array}} TensorMessage
 * @typedef {{shape: number[], values: Float32Array}} DecodedTensor
 */

/**
 * The float32 value of one IEEE 754 binary16 bit pattern (exact: every half is a float).
 * @param {number} bits
 * @returns {number}
 */
function halfToFloat(bits) {
  const sign = bits & 0x8000 ? -1 : 1;
  const exponent = (bits >> 10) & 0x1f;
  const fraction = bits & 0x3ff;
  if (exponent === 0) return sign * fraction * 2 ** -24; // zero and subnormals
  if (exponent === 0x1f) return fraction ? NaN : sign * Infinity;
  return sign * (1 + fraction / 1024) * 2 ** (exponent - 15);
}

/**
 * Decodes a Tensor message to float32; throws naming the mismatch when dtype,
 * shape and byte length disagree.
 * @param {TensorMessage} tensor
 * @returns {DecodedTensor}
 */
function decodeTensor(tensor) {
  const size = ITEM_SIZE[/** @type {keyof typeof ITEM_SIZE} */ (tensor.dtype)];
  if (size === undefined) {
    throw new Error(`tensor.dtype ${JSON.stringify(tensor.dtype)} is not supported; use one of ${Object.keys(ITEM_SIZE).join(', ')}`);
  }
  const shape = tensor.shape.map(Number);
  if (shape.some((d) => !Number.isInteger(d) || d < 0)) {
    throw new Error(`tensor.shape [${shape}] has a negative or non-integer dimension`);
  }
  const count = shape.reduce((a, b) => a * b, 1);
  const data = tensor.data;
  if (data.length !== count * size) {
    throw new Error(`tensor.data has ${data.length} bytes but shape [${shape}] of ${tensor.dtype} needs ${count * size}`);
  }
  const view = new DataView(data.buffer, data.byteOffset, data.byteLength);
  const values = new Float32Array(count);
  const bits = new Uint32Array(values.buffer);
  for (let i = 0; i < count; i++) {
    switch (tensor.dtype) {
      case 'float32': values[i] = view.getFloat32(4 * i, true); break;
      case 'float64': values[i] = view.getFloat64(8 * i, true); break;
      case 'float16': values[i] = halfToFloat(view.getUint16(2 * i, true)); break;
      default: bits[i] = view.getUint16(2 * i, true) << 16; // bfloat16: exact bit copy
    }
  }
  return { shape, values };
}

/**
 * @typedef {object} ActivationRow
 * @property {string} requestId
 * @property {string} point
 * @property {number} layer
 * @property {number} tokenPosition
 * @property {boolean} isGenerated
 * @property {string} dtype  the wire dtype the row travelled in
 * @property {Float32Array} values  one row [hidden_size]
 */

/**
 * Every row of an ActivationBatch with its key (request, point, layer, position).
 * @param {any} batch an ActivationBatch as @grpc/proto-loader decodes it
 * @returns {ActivationRow[]}
 */
function decodeBatch(batch) {
  /** @type {ActivationRow[]} */
  const rows = [];
  batch.blocks.forEach((block, b) => {
    const where = `blocks[${b}] (${block.point}@${block.layer})`;
    let tensor;
    try {
      tensor = decodeTensor(block.rows);
    } catch (err) {
      throw new Error(`${where}.rows: ${/** @type {Error} */ (err).message}`);
    }
    if (tensor.shape.length !== 2) throw new Error(`${where}.rows: shape [${tensor.shape}] is not [rows, hidden]`);
    const [n, hidden] = tensor.shape;
    for (const field of ['requestIndex', 'tokenPositions', 'isGenerated']) {
      if (block[field].length !== n) throw new Error(`${where}.${field}: ${block[field].length} entries for ${n} rows`);
    }
    for (let i = 0; i < n; i++) {
      const requestId = batch.requestIds[block.requestIndex[i]];
      if (requestId === undefined) throw new Error(`${where}.requestIndex: index out of range of ${batch.requestIds.length} request ids`);
      rows.push({
        requestId,
        point: block.point,
        layer: block.layer,
        tokenPosition: Number(block.tokenPositions[i]),
        isGenerated: Boolean(block.isGenerated[i]),
        dtype: block.rows.dtype,
        values: tensor.values.subarray(i * hidden, (i + 1) * hidden),
      });
    }
  });
  return rows;
}

/**
 * The map key of a row: "requestId|point|layer|tokenPosition".
 * @param {{requestId: string, point: string, layer: number, tokenPosition: number}} row
 */
const rowKey = (row) => `${row.requestId}|${row.point}|${row.layer}|${row.tokenPosition}`;

module.exports = { ITEM_SIZE, decodeBatch, decodeTensor, halfToFloat, rowKey };
