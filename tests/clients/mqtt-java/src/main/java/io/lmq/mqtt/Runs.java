package io.lmq.mqtt;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Map;

/** The scenarios, written once over {@link Client}; every topic lies under {@code base} (parent/vN). */
final class Runs {
  /** Makes a client of one protocol version. */
  interface Factory {
    Client make(String id, Scenarios.Inbox inbox) throws Exception;
  }

  private final String version;
  private final String base;
  private final Factory factory;
  private final List<Client> open = new ArrayList<>();

  Runs(String version, String base, Factory factory) {
    this.version = version;
    this.base = base;
    this.factory = factory;
  }

  private Client client(String name, Scenarios.Inbox inbox) throws Exception {
    Client c = factory.make("java" + version.charAt(0) + "-" + name, inbox);
    open.add(c);
    return c;
  }

  private Client connected(String name, Scenarios.Inbox inbox) throws Exception {
    Client c = client(name, inbox);
    c.connect(true, null, null);
    return c;
  }

  void runAll() throws Exception {
    try {
      pubsub();
      retained();
      will();
      session();
      shared();
    } finally {
      for (Client c : open) {
        c.close();
      }
    }
  }

  /** QoS 0 and 1 publishes to an exact and a '+' filter; a topic neither matches. */
  private void pubsub() throws Exception {
    Scenarios.Inbox inbox = new Scenarios.Inbox("sub");
    Client sub = connected("sub", inbox);
    int[] granted = sub.subscribe(new String[] {base + "/room1/temp", base + "/+/hum"}, new int[] {1, 0});
    Client pub = connected("pub", new Scenarios.Inbox("pub"));
    pub.publish(base + "/room1/temp", "t0", 0, false);
    pub.publish(base + "/room1/temp", "t1", 1, false);
    pub.publish(base + "/room2/hum", "h1", 1, false);
    pub.publish(base + "/room2/temp", "nobody", 1, false);
    Scenarios.report(version, "pubsub", inbox.take(3), Map.of("granted", Arrays.stream(granted).boxed().toList()));
  }

  /** Retained messages reach a later subscriber flagged retained; a live one after it is not. */
  private void retained() throws Exception {
    Client pub = connected("rpub", new Scenarios.Inbox("rpub"));
    pub.publish(base + "/ret/a", "r1", 1, true);
    pub.publish(base + "/ret/b", "r2", 1, true);
    Scenarios.Inbox inbox = new Scenarios.Inbox("rsub");
    Client sub = connected("rsub", inbox);
    sub.subscribe(new String[] {base + "/ret/+"}, new int[] {1});
    pub.publish(base + "/ret/a", "live", 1, false);
    Scenarios.report(version, "retained", inbox.take(3), Map.of());
  }

  /** A will is published when a client's connection is lost, not when it disconnects. */
  private void will() throws Exception {
    Scenarios.Inbox inbox = new Scenarios.Inbox("watcher");
    Client watcher = connected("watcher", inbox);
    watcher.subscribe(new String[] {base + "/will/+"}, new int[] {1});
    Client polite = client("polite", new Scenarios.Inbox("polite"));
    polite.connect(true, base + "/will/polite", "polite-gone");
    Client dying = client("dying", new Scenarios.Inbox("dying"));
    dying.connect(true, base + "/will/dying", "dying-gone");
    polite.disconnect();
    dying.kill();
    Scenarios.report(version, "will", inbox.take(1), Map.of());
  }

  /** Two members of one shared subscription (5.0 section 4.8.2; 3.1.1 clients too): each message to one. */
  private void shared() throws Exception {
    Scenarios.Inbox inbox = new Scenarios.Inbox("member-a");
    String share = "$share/workers/" + base + "/jobs/+";
    Client a = connected("member-a", inbox);
    Client b = connected("member-b", new Scenarios.Inbox("member-b", inbox.queue));
    int[] granted = {
      a.subscribe(new String[] {share}, new int[] {1})[0], b.subscribe(new String[] {share}, new int[] {1})[0]
    };
    Client pub = connected("jobs", new Scenarios.Inbox("jobs"));
    for (int n = 0; n < 10; n++) {
      pub.publish(base + "/jobs/" + (n % 2), "job" + n, 1, false);
    }
    Scenarios.report(version, "shared", inbox.take(10), Map.of("granted", Arrays.stream(granted).boxed().toList()));
  }

  /** A persistent session gets, at its next connect, what was published to its subscription while away. */
  private void session() throws Exception {
    Scenarios.Inbox inbox = new Scenarios.Inbox("sess");
    Client away = client("sess", inbox);
    boolean firstPresent = away.connect(false, null, null);
    away.subscribe(new String[] {base + "/sess/x"}, new int[] {1});
    away.disconnect();
    Client pub = connected("spub", new Scenarios.Inbox("spub"));
    pub.publish(base + "/sess/x", "m1", 1, false);
    pub.publish(base + "/sess/x", "m2", 1, false);
    boolean resumedPresent = away.connect(false, null, null);
    List<Scenarios.Delivery> got = inbox.take(2);
    away.disconnect();
    Scenarios.report(
        version, "session", got, Map.of("first_present", firstPresent, "resumed_present", resumedPresent));
  }
}
