package io.lmq.mqtt;

import java.nio.charset.StandardCharsets;
import org.eclipse.paho.client.mqttv3.IMqttDeliveryToken;
import org.eclipse.paho.client.mqttv3.MqttCallback;
import org.eclipse.paho.client.mqttv3.MqttClient;
import org.eclipse.paho.client.mqttv3.MqttConnectOptions;
import org.eclipse.paho.client.mqttv3.MqttMessage;
import org.eclipse.paho.client.mqttv3.persist.MemoryPersistence;

/** Eclipse Paho's MQTT 3.1.1 client (org.eclipse.paho.client.mqttv3). */
final class V3Client implements Client {
  private final MqttClient client;
  private final KillableSockets sockets = new KillableSockets();

  V3Client(String uri, String id, Scenarios.Inbox inbox) throws Exception {
    client = new MqttClient(uri, id, new MemoryPersistence());
    client.setCallback(
        new MqttCallback() {
          @Override
          public void connectionLost(Throwable cause) {}

          @Override
          public void messageArrived(String topic, MqttMessage m) {
            inbox.add(topic, m.getPayload(), m.getQos(), m.isRetained());
          }

          @Override
          public void deliveryComplete(IMqttDeliveryToken token) {}
        });
  }

  @Override
  public boolean connect(boolean clean, String willTopic, String willPayload) throws Exception {
    MqttConnectOptions options = new MqttConnectOptions();
    options.setMqttVersion(MqttConnectOptions.MQTT_VERSION_3_1_1);
    options.setCleanSession(clean);
    options.setAutomaticReconnect(false);
    options.setSocketFactory(sockets);
    if (willTopic != null) {
      options.setWill(willTopic, willPayload.getBytes(StandardCharsets.UTF_8), 1, false);
    }
    return client.connectWithResult(options).getSessionPresent();
  }

  @Override
  public int[] subscribe(String[] filters, int[] qos) throws Exception {
    return client.subscribeWithResponse(filters, qos).getGrantedQos();
  }

  @Override
  public void publish(String topic, String payload, int qos, boolean retained) throws Exception {
    client.publish(topic, payload.getBytes(StandardCharsets.UTF_8), qos, retained);
  }

  @Override
  public void disconnect() throws Exception {
    client.disconnect();
  }

  @Override
  public void kill() throws Exception {
    sockets.killAll();
  }

  @Override
  public void close() {
    try {
      if (client.isConnected()) {
        client.disconnectForcibly(0, 1000, false);
      }
      client.close(true);
    } catch (Exception ignored) {
      // a killed client may already be closing itself
    }
  }
}
