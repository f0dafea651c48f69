package io.lmq.clients;

import com.google.gson.Gson;
import com.google.gson.GsonBuilder;
import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import java.io.BufferedReader;
import java.io.Closeable;
import java.io.FileOutputStream;
import java.io.FileDescriptor;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Base64;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicLong;
import org.apache.rocketmq.client.apis.ClientConfiguration;
import org.apache.rocketmq.client.apis.ClientConfigurationBuilder;
import org.apache.rocketmq.client.apis.ClientServiceProvider;
import org.apache.rocketmq.client.apis.StaticSessionCredentialsProvider;
import org.apache.rocketmq.client.apis.consumer.ConsumeResult;
import org.apache.rocketmq.client.apis.consumer.FilterExpression;
import org.apache.rocketmq.client.apis.consumer.FilterExpressionType;
import org.apache.rocketmq.client.apis.consumer.LitePushConsumer;
import org.apache.rocketmq.client.apis.consumer.MessageListener;
import org.apache.rocketmq.client.apis.consumer.SimpleConsumer;
import org.apache.rocketmq.client.apis.message.MessageBuilder;
import org.apache.rocketmq.client.apis.message.MessageView;
import org.apache.rocketmq.client.apis.producer.Producer;

/**
 * Driver of the official Java client (rocketmq-client-java) for lmq's client suite: JSON lines, requests
 * on stdin, replies and events on stdout (tests/clients/README.md). Everything else goes to stderr.
 */
public final class Driver {
    private static final Gson GSON = new GsonBuilder().serializeNulls().create();
    private static final PrintStream OUT =
        new PrintStream(new FileOutputStream(FileDescriptor.out), true, StandardCharsets.UTF_8);

    private final ClientServiceProvider provider = ClientServiceProvider.loadService();
    private final ClientConfiguration config;
    private final Map<String, Closeable> clients = new LinkedHashMap<>();
    private final Map<String, Object[]> handles = new ConcurrentHashMap<>();
    private final AtomicLong handleIds = new AtomicLong();

    private Driver(String endpoint, String accessKey, String secretKey) {
        // Java defaults to TLS; lmq's broker listens in plaintext unless given --tls-cert/--tls-key.
        ClientConfigurationBuilder builder = ClientConfiguration.newBuilder().setEndpoints(endpoint).enableSsl(false)
            .setRequestTimeout(Duration.ofSeconds(5));
        if (accessKey != null && secretKey != null) { // signed as a user (--acl): MQv2-HMAC-SHA1
            builder.setCredentialProvider(new StaticSessionCredentialsProvider(accessKey, secretKey));
        }
        config = builder.build();
    }

    static synchronized void emit(JsonObject obj) {
        OUT.println(GSON.toJson(obj));
    }

    static JsonObject messageJson(MessageView m) {
        JsonObject o = new JsonObject();
        o.addProperty("topic", m.getTopic());
        o.addProperty("lite_topic", m.getLiteTopic().orElse(null));
        o.addProperty("message_id", m.getMessageId().toString());
        ByteBuffer body = m.getBody().duplicate();
        byte[] bytes = new byte[body.remaining()];
        body.get(bytes);
        o.addProperty("body", Base64.getEncoder().encodeToString(bytes));
        o.addProperty("tag", m.getTag().orElse(null));
        JsonArray keys = new JsonArray();
        List<String> sorted = new ArrayList<>(m.getKeys());
        Collections.sort(sorted);
        sorted.forEach(keys::add);
        o.add("keys", keys);
        o.add("properties", GSON.toJsonTree(new TreeMap<>(m.getProperties())));
        o.addProperty("attempt", m.getDeliveryAttempt());
        return o;
    }

    /** Records each delivery as an event; FAILURE for the first failTimes deliveries of a message id. */
    static MessageListener listener(String name, int failTimes) {
        Map<String, Integer> seen = new ConcurrentHashMap<>();
        return m -> {
            int n = seen.merge(m.getMessageId().toString(), 1, Integer::sum);
            JsonObject event = messageJson(m);
            event.addProperty("event", "message");
            event.addProperty("consumer", name);
            emit(event);
            return n <= failTimes ? ConsumeResult.FAILURE : ConsumeResult.SUCCESS;
        };
    }

    private <T extends Closeable> T client(String name, Class<T> type) {
        Closeable c = clients.get(name);
        if (c == null) {
            throw new IllegalArgumentException("no client named " + name);
        }
        return type.cast(c);
    }

    private static String str(JsonObject a, String key, String otherwise) {
        JsonElement e = a.get(key);
        return e == null || e.isJsonNull() ? otherwise : e.getAsString();
    }

    private static int integer(JsonObject a, String key, int otherwise) {
        JsonElement e = a.get(key);
        return e == null || e.isJsonNull() ? otherwise : e.getAsInt();
    }

    private JsonObject run(String op, JsonObject a) throws Exception {
        JsonObject r = new JsonObject();
        switch (op) {
            case "producer": {
                List<String> topics = new ArrayList<>();
                a.getAsJsonArray("topics").forEach(t -> topics.add(t.getAsString()));
                clients.put(a.get("name").getAsString(), provider.newProducerBuilder().setClientConfiguration(config)
                    .setTopics(topics.toArray(new String[0])).build());
                return r;
            }
            case "send": {
                MessageBuilder b = provider.newMessageBuilder().setTopic(a.get("topic").getAsString())
                    .setBody(Base64.getDecoder().decode(a.get("body").getAsString()));
                String lite = str(a, "lite_topic", null);
                if (lite != null) {
                    b.setLiteTopic(lite);
                }
                String tag = str(a, "tag", null);
                if (tag != null) {
                    b.setTag(tag);
                }
                if (a.has("keys") && !a.get("keys").isJsonNull()) {
                    List<String> keys = new ArrayList<>();
                    a.getAsJsonArray("keys").forEach(k -> keys.add(k.getAsString()));
                    b.setKeys(keys.toArray(new String[0]));
                }
                String group = str(a, "message_group", null);
                if (group != null) {
                    b.setMessageGroup(group);
                }
                if (a.has("properties") && !a.get("properties").isJsonNull()) {
                    for (Map.Entry<String, JsonElement> p : a.getAsJsonObject("properties").entrySet()) {
                        b.addProperty(p.getKey(), p.getValue().getAsString());
                    }
                }
                Producer p = client(a.get("producer").getAsString(), Producer.class);
                r.addProperty("message_id", p.send(b.build()).getMessageId().toString());
                return r;
            }
            case "lite_push": {
                String name = a.get("name").getAsString();
                clients.put(name, provider.newLitePushConsumerBuilder().setClientConfiguration(config)
                    .setConsumerGroup(a.get("group").getAsString()).bindTopic(a.get("topic").getAsString())
                    .setMessageListener(listener(name, integer(a, "fail_times", 0))).build());
                return r;
            }
            case "push": {
                String name = a.get("name").getAsString();
                FilterExpression filter = new FilterExpression(str(a, "expression", "*"), FilterExpressionType.TAG);
                clients.put(name, provider.newPushConsumerBuilder().setClientConfiguration(config)
                    .setConsumerGroup(a.get("group").getAsString())
                    .setSubscriptionExpressions(Collections.singletonMap(a.get("topic").getAsString(), filter))
                    .setMessageListener(listener(name, integer(a, "fail_times", 0))).build());
                return r;
            }
            case "subscribe_lite":
                client(a.get("consumer").getAsString(), LitePushConsumer.class)
                    .subscribeLite(a.get("lite_topic").getAsString());
                return r;
            case "unsubscribe_lite":
                client(a.get("consumer").getAsString(), LitePushConsumer.class)
                    .unsubscribeLite(a.get("lite_topic").getAsString());
                return r;
            case "subscribe_lite_all":
            case "lite_simple":
                // 5.2.0 has neither a public subscribe-all call nor a LiteSimpleConsumer.
                r.addProperty("unsupported", true);
                return r;
            case "lite_topics": {
                JsonArray set = new JsonArray();
                List<String> names = new ArrayList<>(
                    client(a.get("consumer").getAsString(), LitePushConsumer.class).getLiteTopicSet());
                Collections.sort(names);
                names.forEach(set::add);
                r.add("lite_topics", set);
                return r;
            }
            case "simple": {
                FilterExpression filter = new FilterExpression(str(a, "expression", "*"), FilterExpressionType.TAG);
                clients.put(a.get("name").getAsString(), provider.newSimpleConsumerBuilder()
                    .setClientConfiguration(config).setConsumerGroup(a.get("group").getAsString())
                    .setAwaitDuration(Duration.ofMillis((long) (a.has("await_s") ? a.get("await_s").getAsDouble() * 1000 : 5000)))
                    .setSubscriptionExpressions(Collections.singletonMap(a.get("topic").getAsString(), filter)).build());
                return r;
            }
            case "receive": {
                String consumer = a.get("consumer").getAsString();
                List<MessageView> got = client(consumer, SimpleConsumer.class)
                    .receive(a.get("max").getAsInt(), Duration.ofSeconds(a.get("invisible_s").getAsLong()));
                JsonArray out = new JsonArray();
                for (MessageView m : got) {
                    String handle = Long.toString(handleIds.getAndIncrement());
                    handles.put(handle, new Object[] {consumer, m});
                    JsonObject o = messageJson(m);
                    o.addProperty("handle", handle);
                    out.add(o);
                }
                r.add("messages", out);
                return r;
            }
            case "ack": {
                String consumer = a.get("consumer").getAsString();
                Object[] held = handles.remove(a.get("handle").getAsString());
                if (held == null || !consumer.equals(held[0])) {
                    throw new IllegalArgumentException("unknown handle for " + consumer);
                }
                client(consumer, SimpleConsumer.class).ack((MessageView) held[1]);
                return r;
            }
            case "shutdown": {
                Closeable c = clients.remove(a.get("name").getAsString());
                if (c == null) {
                    throw new IllegalArgumentException("no client named " + a.get("name").getAsString());
                }
                c.close();
                return r;
            }
            default:
                throw new IllegalArgumentException("unknown op " + op);
        }
    }

    /** The exception and its causes: a failed start hides the broker's answer two causes down. */
    static String describe(Throwable e) {
        StringBuilder text = new StringBuilder();
        for (Throwable t = e; t != null; t = t.getCause() == t ? null : t.getCause()) {
            if (text.length() > 0) {
                text.append(" <- ");
            }
            text.append(t.getClass().getSimpleName()).append(": ").append(t.getMessage());
        }
        return text.toString();
    }

    private void closeAll() {
        List<String> names = new ArrayList<>(clients.keySet());
        Collections.reverse(names);
        for (String name : names) {
            try {
                clients.remove(name).close();
            } catch (Exception e) {
                e.printStackTrace();
            }
        }
    }

    public static void main(String[] args) throws Exception {
        System.setOut(System.err); // a client that prints must not corrupt the protocol
        String endpoint = null;
        String accessKey = null;
        String secretKey = System.getenv("LMQ_DRIVER_SECRET_KEY"); // kept out of the process list
        for (int i = 0; i < args.length - 1; i++) {
            if (args[i].equals("--endpoint")) {
                endpoint = args[i + 1];
            } else if (args[i].equals("--access-key")) {
                accessKey = args[i + 1];
            }
        }
        Driver driver = new Driver(endpoint, accessKey, secretKey);
        JsonObject ready = new JsonObject();
        ready.addProperty("event", "ready");
        emit(ready);
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line;
        while ((line = in.readLine()) != null) {
            if (line.isBlank()) {
                continue;
            }
            JsonObject request = GSON.fromJson(line, JsonObject.class);
            long id = request.get("id").getAsLong();
            String op = request.get("op").getAsString();
            JsonObject reply;
            if (op.equals("exit")) {
                driver.closeAll();
                reply = new JsonObject();
                reply.addProperty("id", id);
                reply.addProperty("ok", true);
                emit(reply);
                System.exit(0);
            }
            try {
                reply = driver.run(op, request);
                reply.addProperty("ok", true);
            } catch (Exception e) {
                e.printStackTrace();
                reply = new JsonObject();
                reply.addProperty("ok", false);
                reply.addProperty("error", describe(e));
                reply.add("code", null);
            }
            reply.addProperty("id", id);
            emit(reply);
        }
        driver.closeAll();
        System.exit(0);
    }
}
