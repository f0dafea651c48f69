// Producer -> LitePushConsumer with github.com/apache/rocketmq-clients/golang/v5 v5.1.4 against lmq
// (plaintext, no credentials). Run: go run .
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	rmq "github.com/apache/rocketmq-clients/golang/v5"
	"github.com/apache/rocketmq-clients/golang/v5/credentials"
)

func main() {
	endpoint := os.Getenv("LMQ_ENDPOINT")
	if endpoint == "" {
		endpoint = "127.0.0.1:8081"
	}
	rmq.EnableSsl = false // Go defaults to TLS; lmq listens in plaintext unless given a certificate
	done := make(chan struct{}, 1)
	consumer, err := rmq.NewLitePushConsumer(
		&rmq.Config{Endpoint: endpoint, ConsumerGroup: "executor-group", Credentials: &credentials.SessionCredentials{}},
		rmq.NewLitePushConsumerConfig("AGENT_TASK_NS", 30*time.Second),
		rmq.WithPushMessageListener(&rmq.FuncMessageListener{Consume: func(m *rmq.MessageView) rmq.ConsumerResult {
			fmt.Println(m.GetLiteTopic(), string(m.GetBody()))
			done <- struct{}{}
			return rmq.SUCCESS
		}}))
	if err == nil {
		err = consumer.Start()
	}
	if err == nil {
		err = consumer.SubscribeLite("session-1")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		os.Exit(1)
	}
	defer consumer.GracefulStop()
	producer, err := rmq.NewProducer(&rmq.Config{Endpoint: endpoint, Credentials: &credentials.SessionCredentials{}},
		rmq.WithTopics("AGENT_TASK_NS"))
	if err == nil {
		err = producer.Start()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "producer:", err)
		os.Exit(1)
	}
	defer producer.GracefulStop()
	message := &rmq.Message{Topic: "AGENT_TASK_NS", Body: []byte("hello lite")}
	message.SetLiteTopic("session-1")
	if _, err := producer.Send(context.Background(), message); err != nil {
		fmt.Fprintln(os.Stderr, "send:", err)
		os.Exit(1)
	}
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		fmt.Fprintln(os.Stderr, "nothing received")
		os.Exit(1)
	}
}
