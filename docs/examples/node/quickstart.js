// Producer -> LitePushConsumer with rocketmq-client-nodejs 1.0.8 against lmq (plaintext, no credentials).
// Run: npm install rocketmq-client-nodejs@1.0.8 && node quickstart.js
'use strict';
const { Producer, LitePushConsumerImpl, ConsumeResult, FilterExpression } = require('rocketmq-client-nodejs');

async function main() {
  const endpoints = process.env.LMQ_ENDPOINT || '127.0.0.1:8081';
  const quiet = { info() {}, warn() {}, error: console.error, debug() {} };
  const options = { endpoints, namespace: '', sslEnabled: false, logger: quiet };
  let received;
  const done = new Promise(resolve => { received = resolve; });
  const consumer = new LitePushConsumerImpl({
    ...options, consumerGroup: 'executor-group', bindTopic: 'AGENT_TASK_NS',
    subscriptions: new Map([['AGENT_TASK_NS', FilterExpression.SUB_ALL]]),
    messageListener: {
      async consume(message) {
        console.log(message.liteTopic, message.body.toString());
        received();
        return ConsumeResult.SUCCESS;
      },
    },
  });
  await consumer.startup();
  await consumer.subscribeLite('session-1');
  const producer = new Producer({ ...options, topics: ['AGENT_TASK_NS'] });
  await producer.startup();
  await producer.send({ topic: 'AGENT_TASK_NS', liteTopic: 'session-1', body: Buffer.from('hello lite') });
  const timeout = new Promise((_, reject) => setTimeout(() => reject(new Error('nothing received')), 10000));
  await Promise.race([done, timeout]);
  await producer.shutdown();
  await consumer.shutdown();
}

main().then(() => process.exit(0), error => { console.error(error); process.exit(1); });
