package io.lmq.mqtt;

import com.google.gson.Gson;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;

/**
 * MQTT scenarios run by Eclipse Paho for Java against an lmq broker: publish at QoS 0 and 1, exact and '+'
 * filters under an existing parent topic, retained messages, a will published on an abrupt close, and a
 * persistent session resumed. Each scenario prints one JSON line (what each client received); the Python test
 * (tests/mqtt/test_java_paho.py) asserts on it, so this program only drives the client and never judges.
 *
 * <p>Usage: Scenarios --port N --parent P [--version 3|5 ...] (default: both).
 */
public final class Scenarios {
  static final long WAIT_MS = 15_000;
  static final long QUIET_MS = 500; // after the expected count: anything more (a duplicate) is reported too
  private static final Gson GSON = new Gson();

  /** One delivery as the client saw it. */
  record Delivery(String client, String topic, String payload, int qos, boolean retained) {}

  /** What arrived at one client's callback, in order. */
  static final class Inbox {
    final String client;
    final BlockingQueue<Delivery> queue;

    Inbox(String client) {
      this(client, new LinkedBlockingQueue<>());
    }

    /** An inbox writing into another's queue: several clients' deliveries in one arrival order. */
    Inbox(String client, BlockingQueue<Delivery> queue) {
      this.client = client;
      this.queue = queue;
    }

    void add(String topic, byte[] payload, int qos, boolean retained) {
      queue.add(new Delivery(client, topic, new String(payload, java.nio.charset.StandardCharsets.UTF_8), qos, retained));
    }

    /** Up to {@code count} deliveries within the deadline, then whatever else arrives in a short quiet period. */
    List<Delivery> take(int count) throws InterruptedException {
      List<Delivery> out = new ArrayList<>();
      long deadline = System.currentTimeMillis() + WAIT_MS;
      while (out.size() < count) {
        Delivery d = queue.poll(Math.max(1, deadline - System.currentTimeMillis()), TimeUnit.MILLISECONDS);
        if (d == null) {
          break;
        }
        out.add(d);
      }
      Delivery extra;
      while ((extra = queue.poll(QUIET_MS, TimeUnit.MILLISECONDS)) != null) {
        out.add(extra);
      }
      return out;
    }
  }

  static void report(String version, String scenario, List<Delivery> received, Map<String, Object> extra) {
    Map<String, Object> line = new LinkedHashMap<>();
    line.put("version", version);
    line.put("scenario", scenario);
    line.put("received", received);
    line.putAll(extra);
    System.out.println(GSON.toJson(line));
    System.out.flush();
  }

  public static void main(String[] args) throws Exception {
    int port = 0;
    String parent = null;
    List<String> versions = new ArrayList<>();
    for (int i = 0; i < args.length - 1; i += 2) {
      switch (args[i]) {
        case "--port" -> port = Integer.parseInt(args[i + 1]);
        case "--parent" -> parent = args[i + 1];
        case "--version" -> versions.add(args[i + 1]);
        default -> throw new IllegalArgumentException("unknown argument " + args[i]);
      }
    }
    if (port == 0 || parent == null) {
      throw new IllegalArgumentException("usage: Scenarios --port N --parent P [--version 3|5]");
    }
    String uri = "tcp://127.0.0.1:" + port;
    if (versions.isEmpty() || versions.contains("3")) {
      new Runs("3.1.1", parent + "/v3", (id, inbox) -> new V3Client(uri, id, inbox)).runAll();
    }
    if (versions.isEmpty() || versions.contains("5")) {
      new Runs("5.0", parent + "/v5", (id, inbox) -> new V5Client(uri, id, inbox)).runAll();
    }
    System.out.println("{\"event\": \"done\"}");
  }

  private Scenarios() {}
}
