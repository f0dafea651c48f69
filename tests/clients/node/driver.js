'use strict';
// Driver of the official Node.js client (rocketmq-client-nodejs) for lmq's client suite.
// Contract: tests/clients/README.md (JSON lines: requests on stdin, replies and events on stdout).
const readline = require('node:readline');
const {
  Producer, PushConsumer, SimpleConsumer, LitePushConsumerImpl, ConsumeResult, FilterExpression,
} = require('rocketmq-client-nodejs');

const endpoint = process.argv[process.argv.indexOf('--endpoint') + 1];
// The client logs through this logger; stdout carries only the protocol.
const logger = {
  info: (...a) => process.stderr.write(`INFO ${a.join(' ')}\n`),
  warn: (...a) => process.stderr.write(`WARN ${a.join(' ')}\n`),
  error: (...a) => process.stderr.write(`ERROR ${a.map(x => (x && x.stack) || x).join(' ')}\n`),
  debug: () => {},
};
const base = { endpoints: endpoint, namespace: '', sslEnabled: false, requestTimeout: 5000, logger };
const clients = new Map();
const handles = new Map();
let handleIds = 0;

function emit(obj) { process.stdout.write(JSON.stringify(obj) + '\n'); }

function messageJson(m) {
  return {
    topic: m.topic,
    lite_topic: m.liteTopic || null,
    message_id: m.messageId,
    body: Buffer.from(m.body).toString('base64'),
    tag: m.tag || null,
    keys: [...(m.keys || [])].sort(),
    properties: Object.fromEntries(m.properties || new Map()),
    attempt: m.deliveryAttempt,
  };
}

function listener(name, failTimes) {
  const seen = new Map();
  return {
    async consume(m) {
      const n = (seen.get(m.messageId) || 0) + 1;
      seen.set(m.messageId, n);
      emit({ event: 'message', consumer: name, ...messageJson(m) });
      return n <= failTimes ? ConsumeResult.FAILURE : ConsumeResult.SUCCESS;
    },
  };
}

function client(name) {
  if (!clients.has(name)) throw new Error(`no client named ${name}`);
  return clients.get(name);
}

async function start(name, c) {
  await c.startup();
  clients.set(name, c);
  return {};
}

const ops = {
  producer: ({ name, topics }) => start(name, new Producer({ ...base, topics })),
  async send({ producer, topic, body, lite_topic, tag, keys, message_group, properties }) {
    const receipt = await client(producer).send({
      topic,
      body: Buffer.from(body, 'base64'),
      ...(lite_topic != null && { liteTopic: lite_topic }),
      ...(tag != null && { tag }),
      ...(keys && { keys }),
      ...(message_group != null && { messageGroup: message_group }),
      ...(properties && { properties: new Map(Object.entries(properties)) }),
    });
    return { message_id: receipt.messageId };
  },
  lite_push: ({ name, group, topic, fail_times = 0 }) => start(name, new LitePushConsumerImpl({
    ...base, consumerGroup: group, bindTopic: topic, subscriptions: new Map([[topic, FilterExpression.SUB_ALL]]),
    messageListener: listener(name, fail_times),
  })),
  push: ({ name, group, topic, expression = '*', fail_times = 0 }) => start(name, new PushConsumer({
    ...base, consumerGroup: group, subscriptions: new Map([[topic, expression]]),
    messageListener: listener(name, fail_times),
  })),
  async subscribe_lite({ consumer, lite_topic }) { await client(consumer).subscribeLite(lite_topic); return {}; },
  async unsubscribe_lite({ consumer, lite_topic }) { await client(consumer).unsubscribeLite(lite_topic); return {}; },
  // 1.0.8 has no public subscribe-all call (its periodic full sync is private).
  subscribe_lite_all: async () => ({ unsupported: true }),
  lite_topics: async ({ consumer }) => ({ lite_topics: [...client(consumer).getLiteTopicSet()].sort() }),
  simple: ({ name, group, topic, expression = '*', await_s = 5 }) => start(name, new SimpleConsumer({
    ...base, consumerGroup: group, subscriptions: new Map([[topic, expression]]), awaitDuration: await_s * 1000,
  })),
  // 1.0.8 ships no LiteSimpleConsumer.
  lite_simple: async () => ({ unsupported: true }),
  async receive({ consumer, max, invisible_s }) {
    const messages = await client(consumer).receive(max, invisible_s * 1000);
    return {
      messages: messages.map(m => {
        const handle = String(handleIds++);
        handles.set(handle, [consumer, m]);
        return { ...messageJson(m), handle };
      }),
    };
  },
  async ack({ consumer, handle }) {
    const [owner, m] = handles.get(handle);
    if (owner !== consumer) throw new Error(`handle ${handle} belongs to ${owner}`);
    handles.delete(handle);
    await client(consumer).ack(m);
    return {};
  },
  async shutdown({ name }) { const c = client(name); clients.delete(name); await c.shutdown(); return {}; },
};

async function shutdownAll() {
  for (const [name, c] of [...clients.entries()].reverse()) {
    clients.delete(name);
    try { await c.shutdown(); } catch (e) { logger.error('shutdown', name, e); }
  }
}

async function main() {
  const lines = readline.createInterface({ input: process.stdin });
  emit({ event: 'ready' });
  for await (const line of lines) {
    if (!line.trim()) continue;
    const { id, op, ...args } = JSON.parse(line);
    if (op === 'exit') {
      await shutdownAll();
      emit({ id, ok: true });
      process.exit(0);
    }
    try {
      if (!ops[op]) throw new Error(`unknown op ${op}`);
      emit({ id, ok: true, ...(await ops[op](args)) });
    } catch (e) {
      logger.error(op, e);
      emit({ id, ok: false, error: `${e.name}: ${e.message}`, code: e.code ?? null });
    }
  }
  await shutdownAll();
  process.exit(0);
}

main();
