// @ts-check
'use strict';
/**
 * Node.js client of Undercurrent: EngineService (generate, abort, model info) and
 * ProbeAdminService (load, list, unload), loaded at run time from the same .proto
 * files the services use. Messages use proto-loader's camelCase field names,
 * enum values as their names ("FINISH_REASON_PROBE_ABORT"), int64 as numbers.
 */
const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { decodeBatch, decodeTensor, rowKey } = require('./tensor');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', '..', 'proto');
// The public APIs only; their shared types come in through their imports. The
// router session (router_session.proto) is internal to engines and routers.
const PROTO_FILES = ['undercurrent/v1/engine.proto', 'undercurrent/v1/admin.proto'];
const MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

const packageDefinition = protoLoader.loadSync(PROTO_FILES, {
  includeDirs: [PROTO_ROOT], longs: Number, enums: String, bytes: Buffer, defaults: true, oneofs: true,
});
const v1 = /** @type {any} */ (grpc.loadPackageDefinition(packageDefinition)).undercurrent.v1;

/**
 * @typedef {object} ConnectionOptions
 * @property {Buffer|string} [rootCert] PEM (or a path to it) of the CA that signed the server: TLS
 * @property {Buffer|string} [clientCert] PEM (or a path) of a client certificate for mutual TLS (routers require one)
 * @property {Buffer|string} [clientKey] PEM (or a path) of clientCert's private key
 * @property {string} [token] sent as `authorization: Bearer <token>` on every call
 * @property {number} [maxMessageBytes] largest message sent or received (default 64 MiB)
 * @property {number} [deadlineMs] deadline of unary calls (default 30000)
 */

/**
 * @typedef {{type: 'started', requestId: string, promptTokens: number}
 *   | {type: 'tokens', tokenIds: number[], text: string, firstIndex: number}
 *   | {type: 'probeScores', probe: string, tokenPositions: number[], scores: number[], router: string}
 *   | {type: 'activations', batch: any}
 *   | {type: 'finished', reason: string, verdict: any, promptTokens: number, generatedTokens: number,
 *      unprobedTokens: number, droppedRecords: number, message: string}} GenerateEvent
 */

/** A failed call: `code` is the gRPC status name ("NOT_FOUND"), `details` the server's message. */
class RpcError extends Error {
  /** @param {string} method @param {any} err */
  constructor(method, err) {
    const code = grpc.status[err.code] ?? String(err.code);
    super(`${method} failed with ${code}: ${err.details}`);
    this.method = method;
    this.code = code;
    this.details = err.details;
  }
}

/** PEM bytes from a Buffer or a file path; null when absent. @param {Buffer|string|undefined} value */
function pem(value) {
  if (!value) return null;
  return Buffer.isBuffer(value) ? value : fs.readFileSync(value);
}

/** @param {ConnectionOptions} options */
function channelArgs(options) {
  if (Boolean(options.clientCert) !== Boolean(options.clientKey)) throw new TypeError('clientCert and clientKey go together');
  if (options.clientCert && !options.rootCert) throw new TypeError('clientCert needs rootCert (mutual TLS)');
  const credentials = options.rootCert
    ? grpc.credentials.createSsl(pem(options.rootCert), pem(options.clientKey), pem(options.clientCert))
    : grpc.credentials.createInsecure();
  const limit = options.maxMessageBytes ?? MAX_MESSAGE_BYTES;
  return [credentials, { 'grpc.max_send_message_length': limit, 'grpc.max_receive_message_length': limit }];
}

class _Client {
  /** @param {any} Stub @param {string} target @param {ConnectionOptions} options */
  constructor(Stub, target, options = {}) {
    const [credentials, args] = channelArgs(options);
    this.stub = new Stub(target, credentials, args);
    this.deadlineMs = options.deadlineMs ?? 30000;
    this.metadata = new grpc.Metadata();
    if (options.token) this.metadata.set('authorization', `Bearer ${options.token}`);
  }

  /** @param {string} method @param {object} request @returns {Promise<any>} */
  unary(method, request) {
    return new Promise((resolve, reject) => {
      const deadline = new Date(Date.now() + this.deadlineMs);
      this.stub[method](request, this.metadata, { deadline }, (/** @type {any} */ err, /** @type {any} */ response) => {
        if (err) reject(new RpcError(method, err));
        else resolve(response);
      });
    });
  }

  close() {
    this.stub.close();
  }
}

/** @param {any} response a GenerateResponse @returns {GenerateEvent} */
function eventOf(response) {
  switch (response.event) {
    case 'started': return { type: 'started', requestId: response.started.requestId, promptTokens: response.started.promptTokens };
    case 'tokens': return { type: 'tokens', tokenIds: response.tokens.tokenIds, text: response.tokens.text, firstIndex: response.tokens.firstIndex };
    case 'probeEvent': {
      const s = response.probeEvent.scores;
      return { type: 'probeScores', probe: s.probe, tokenPositions: s.tokenPositions, scores: s.scores, router: s.router };
    }
    case 'activations': return { type: 'activations', batch: response.activations };
    case 'finished': {
      const f = response.finished;
      return {
        type: 'finished', reason: f.finishReason.replace(/^FINISH_REASON_/, ''), verdict: f.verdict,
        promptTokens: f.promptTokens, generatedTokens: f.generatedTokens, unprobedTokens: f.unprobedTokens,
        droppedRecords: f.droppedRecords, message: f.message,
      };
    }
    default: throw new Error(`GenerateResponse carries no known event (got ${response.event})`);
  }
}

/** EngineService: generate with probes, abort, model info. */
class EngineClient extends _Client {
  /** @param {string} target "host:port" @param {ConnectionOptions} [options] */
  constructor(target, options) {
    super(v1.EngineService, target, options);
  }

  /**
   * Streams typed events; breaking out of the loop cancels the stream (which aborts the request).
   * @param {object} request a GenerateRequest, e.g. {text, sampling: {maxTokens}, probes: [{probe}]}
   * @returns {AsyncGenerator<GenerateEvent>}
   */
  async *generate(request) {
    const call = this.stub.Generate(request, this.metadata);
    try {
      for await (const response of call) yield eventOf(response);
    } catch (err) {
      throw new RpcError('Generate', err);
    } finally {
      call.cancel();
    }
  }

  /** @param {string} requestId @returns {Promise<boolean>} false when no such request runs */
  async abort(requestId) {
    return (await this.unary('Abort', { requestId })).found;
  }

  /** @returns {Promise<any>} the ModelInfo */
  async modelInfo() {
    return (await this.unary('GetModelInfo', {})).model;
  }
}

/** ProbeAdminService on one router replica. */
class ProbeAdminClient extends _Client {
  /** @param {string} target "host:port" @param {ConnectionOptions} [options] */
  constructor(target, options) {
    super(v1.ProbeAdminService, target, options);
  }

  /**
   * Loads a probe: {path} on the router's disk, or {manifestJson, weightsSafetensors} inline.
   * @param {{path?: string, manifestJson?: string, weightsSafetensors?: Buffer}} source
   * @param {{replace?: boolean}} [options]
   * @returns {Promise<any>} the ProbeInfo
   */
  async load(source, { replace = false } = {}) {
    const request = source.path !== undefined
      ? { path: source.path, replace }
      : { inline: { manifestJson: source.manifestJson, weightsSafetensors: source.weightsSafetensors ?? Buffer.alloc(0) }, replace };
    return (await this.unary('LoadProbe', request)).probe;
  }

  /** @returns {Promise<any[]>} every loaded ProbeInfo */
  async list() {
    return (await this.unary('ListProbes', {})).probes;
  }

  /** @param {string} name @param {{force?: boolean}} [options] @returns {Promise<boolean>} */
  async unload(name, { force = false } = {}) {
    return (await this.unary('UnloadProbe', { name, force })).unloaded;
  }
}

module.exports = {
  EngineClient, ProbeAdminClient, RpcError, decodeBatch, decodeTensor, eventOf, packageDefinition, rowKey,
};
