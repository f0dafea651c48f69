// Producer -> LitePushConsumer with rocketmq-client-java 5.2.0 against lmq (plaintext, no credentials).
// Run: java -cp 'lib/*' QuickStart.java   (lib/ = rocketmq-client-java 5.2.0 and its dependencies)
import java.nio.charset.StandardCharsets;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import org.apache.rocketmq.client.apis.ClientConfiguration;
import org.apache.rocketmq.client.apis.ClientServiceProvider;
import org.apache.rocketmq.client.apis.consumer.ConsumeResult;
import org.apache.rocketmq.client.apis.consumer.LitePushConsumer;
import org.apache.rocketmq.client.apis.producer.Producer;

public class QuickStart {
    public static void main(String[] args) throws Exception {
        String endpoint = System.getenv().getOrDefault("LMQ_ENDPOINT", "127.0.0.1:8081");
        ClientServiceProvider provider = ClientServiceProvider.loadService();
        // Java defaults to TLS; lmq listens in plaintext unless started with --tls-cert/--tls-key.
        ClientConfiguration config = ClientConfiguration.newBuilder().setEndpoints(endpoint).enableSsl(false).build();
        CountDownLatch done = new CountDownLatch(1);
        LitePushConsumer consumer = provider.newLitePushConsumerBuilder().setClientConfiguration(config)
            .setConsumerGroup("executor-group").bindTopic("AGENT_TASK_NS")
            .setMessageListener(message -> {
                System.out.println(message.getLiteTopic().orElse("") + " "
                    + StandardCharsets.UTF_8.decode(message.getBody()));
                done.countDown();
                return ConsumeResult.SUCCESS;
            }).build();
        consumer.subscribeLite("session-1");
        Producer producer = provider.newProducerBuilder().setClientConfiguration(config).setTopics("AGENT_TASK_NS").build();
        producer.send(provider.newMessageBuilder().setTopic("AGENT_TASK_NS").setLiteTopic("session-1")
            .setBody("hello lite".getBytes(StandardCharsets.UTF_8)).build());
        boolean received = done.await(30, TimeUnit.SECONDS);
        producer.close();
        consumer.close();
        System.exit(received ? 0 : 1);
    }
}
