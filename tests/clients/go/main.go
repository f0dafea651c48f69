// Driver of the official Go client (github.com/apache/rocketmq-clients/golang/v5) for lmq's client
// suite: JSON lines, requests on stdin, replies and events on stdout (tests/clients/README.md).
package main

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"reflect"
	"sort"
	"strconv"
	"sync"
	"time"
	"unsafe"

	rmq "github.com/apache/rocketmq-clients/golang/v5"
	"github.com/apache/rocketmq-clients/golang/v5/credentials"
)

var (
	out     = bufio.NewWriter(os.Stdout)
	outLock sync.Mutex
)

func emit(obj map[string]any) {
	line, _ := json.Marshal(obj)
	outLock.Lock()
	defer outLock.Unlock()
	out.Write(line)
	out.WriteByte('\n')
	out.Flush()
}

func messageJSON(m *rmq.MessageView) map[string]any {
	keys := append([]string{}, m.GetKeys()...)
	sort.Strings(keys)
	var liteTopic, tag any
	if m.GetLiteTopic() != "" {
		liteTopic = m.GetLiteTopic()
	}
	if m.GetTag() != nil && *m.GetTag() != "" {
		tag = *m.GetTag()
	}
	props := m.GetProperties()
	if props == nil {
		props = map[string]string{}
	}
	return map[string]any{
		"topic":      m.GetTopic(),
		"lite_topic": liteTopic,
		"message_id": m.GetMessageId(),
		"body":       base64.StdEncoding.EncodeToString(m.GetBody()),
		"tag":        tag,
		"keys":       keys,
		"properties": props,
		"attempt":    m.GetDeliveryAttempt(),
	}
}

type stoppable interface{ GracefulStop() error }

type driver struct {
	config  *rmq.Config
	clients map[string]stoppable
	order   []string
	handles map[string][2]any
	nextID  int
}

func (d *driver) client(name string) (stoppable, error) {
	c, ok := d.clients[name]
	if !ok {
		return nil, fmt.Errorf("no client named %s", name)
	}
	return c, nil
}

func (d *driver) add(name string, c stoppable) {
	d.clients[name] = c
	d.order = append(d.order, name)
}

func (d *driver) configFor(group string) *rmq.Config {
	c := *d.config
	c.ConsumerGroup = group
	return &c
}

// listener records each delivery as an event; FAILURE for the first failTimes deliveries of a message.
func listener(name string, failTimes int) rmq.PushConsumerOption {
	var mu sync.Mutex
	seen := map[string]int{}
	return rmq.WithPushMessageListener(&rmq.FuncMessageListener{Consume: func(m *rmq.MessageView) rmq.ConsumerResult {
		mu.Lock()
		seen[m.GetMessageId()]++
		n := seen[m.GetMessageId()]
		mu.Unlock()
		event := messageJSON(m)
		event["event"] = "message"
		event["consumer"] = name
		emit(event)
		if n <= failTimes {
			return rmq.FAILURE
		}
		return rmq.SUCCESS
	}})
}

// liteTopicSet reads the client's local lite-topic set, which v5.1.4 does not expose: it is where a
// NotifyUnsubscribeLiteCommand shows.
func liteTopicSet(c rmq.LitePushConsumer) []string {
	settings := reflect.ValueOf(c).Elem().FieldByName("litePushConsumerSettings")
	settings = reflect.NewAt(settings.Type(), unsafe.Pointer(settings.UnsafeAddr())).Elem()
	set := settings.Elem().FieldByName("liteTopicSet")
	m := reflect.NewAt(set.Type(), unsafe.Pointer(set.UnsafeAddr())).Elem().Interface().(*sync.Map)
	names := []string{}
	m.Range(func(k, _ any) bool { names = append(names, k.(string)); return true })
	sort.Strings(names)
	return names
}

func str(a map[string]any, key, otherwise string) string {
	if v, ok := a[key].(string); ok {
		return v
	}
	return otherwise
}

func num(a map[string]any, key string, otherwise float64) float64 {
	if v, ok := a[key].(float64); ok {
		return v
	}
	return otherwise
}

func (d *driver) run(op string, a map[string]any) (map[string]any, error) {
	ctx := context.Background()
	r := map[string]any{}
	switch op {
	case "producer":
		topics := []string{}
		for _, t := range a["topics"].([]any) {
			topics = append(topics, t.(string))
		}
		p, err := rmq.NewProducer(d.config, rmq.WithTopics(topics...))
		if err != nil {
			return nil, err
		}
		if err := p.Start(); err != nil {
			return nil, err
		}
		d.add(str(a, "name", ""), p)
	case "send":
		c, err := d.client(str(a, "producer", ""))
		if err != nil {
			return nil, err
		}
		body, err := base64.StdEncoding.DecodeString(str(a, "body", ""))
		if err != nil {
			return nil, err
		}
		m := &rmq.Message{Topic: str(a, "topic", ""), Body: body}
		if v, ok := a["lite_topic"].(string); ok {
			m.SetLiteTopic(v)
		}
		if v, ok := a["tag"].(string); ok {
			m.SetTag(v)
		}
		if keys, ok := a["keys"].([]any); ok {
			all := make([]string, 0, len(keys)) // SetKeys replaces the message's keys: one call with all of them
			for _, k := range keys {
				all = append(all, k.(string))
			}
			m.SetKeys(all...)
		}
		if v, ok := a["message_group"].(string); ok {
			m.SetMessageGroup(v)
		}
		if props, ok := a["properties"].(map[string]any); ok {
			for k, v := range props {
				m.AddProperty(k, v.(string))
			}
		}
		receipts, err := c.(rmq.Producer).Send(ctx, m)
		if err != nil {
			return nil, err
		}
		r["message_id"] = receipts[0].MessageID
	case "lite_push":
		name := str(a, "name", "")
		c, err := rmq.NewLitePushConsumer(d.configFor(str(a, "group", "")),
			rmq.NewLitePushConsumerConfig(str(a, "topic", ""), 30*time.Second),
			listener(name, int(num(a, "fail_times", 0))))
		if err != nil {
			return nil, err
		}
		if err := c.Start(); err != nil {
			return nil, err
		}
		d.add(name, c)
	case "push":
		name := str(a, "name", "")
		c, err := rmq.NewPushConsumer(d.configFor(str(a, "group", "")),
			rmq.WithPushSubscriptionExpressions(map[string]*rmq.FilterExpression{
				str(a, "topic", ""): rmq.NewFilterExpression(str(a, "expression", "*")),
			}),
			listener(name, int(num(a, "fail_times", 0))))
		if err != nil {
			return nil, err
		}
		if err := c.Start(); err != nil {
			return nil, err
		}
		d.add(name, c)
	case "subscribe_lite", "unsubscribe_lite", "lite_topics":
		c, err := d.client(str(a, "consumer", ""))
		if err != nil {
			return nil, err
		}
		lite := c.(rmq.LitePushConsumer)
		switch op {
		case "subscribe_lite":
			err = lite.SubscribeLite(str(a, "lite_topic", ""))
		case "unsubscribe_lite":
			err = lite.UnSubscribeLite(str(a, "lite_topic", ""))
		default:
			r["lite_topics"] = liteTopicSet(lite)
		}
		if err != nil {
			return nil, err
		}
	case "subscribe_lite_all", "lite_simple":
		// v5.1.4 has neither a public subscribe-all call nor a LiteSimpleConsumer.
		r["unsupported"] = true
	case "simple":
		c, err := rmq.NewSimpleConsumer(d.configFor(str(a, "group", "")),
			rmq.WithSimpleAwaitDuration(time.Duration(num(a, "await_s", 5)*float64(time.Second))),
			rmq.WithSimpleSubscriptionExpressions(map[string]*rmq.FilterExpression{
				str(a, "topic", ""): rmq.NewFilterExpression(str(a, "expression", "*")),
			}))
		if err != nil {
			return nil, err
		}
		if err := c.Start(); err != nil {
			return nil, err
		}
		d.add(str(a, "name", ""), c)
	case "receive":
		name := str(a, "consumer", "")
		c, err := d.client(name)
		if err != nil {
			return nil, err
		}
		got, err := c.(rmq.SimpleConsumer).Receive(ctx, int32(num(a, "max", 16)),
			time.Duration(num(a, "invisible_s", 30))*time.Second)
		var status *rmq.ErrRpcStatus
		if errors.As(err, &status) && status.GetCode() == 40401 { // MESSAGE_NOT_FOUND: nothing to receive
			got, err = nil, nil
		}
		if err != nil {
			return nil, err
		}
		messages := []any{}
		for _, m := range got {
			handle := strconv.Itoa(d.nextID)
			d.nextID++
			d.handles[handle] = [2]any{name, m}
			o := messageJSON(m)
			o["handle"] = handle
			messages = append(messages, o)
		}
		r["messages"] = messages
	case "ack":
		name := str(a, "consumer", "")
		held, ok := d.handles[str(a, "handle", "")]
		if !ok || held[0] != name {
			return nil, fmt.Errorf("unknown handle for %s", name)
		}
		delete(d.handles, str(a, "handle", ""))
		c, err := d.client(name)
		if err != nil {
			return nil, err
		}
		if err := c.(rmq.SimpleConsumer).Ack(ctx, held[1].(*rmq.MessageView)); err != nil {
			return nil, err
		}
	case "shutdown":
		name := str(a, "name", "")
		c, err := d.client(name)
		if err != nil {
			return nil, err
		}
		delete(d.clients, name)
		if err := c.GracefulStop(); err != nil {
			return nil, err
		}
	default:
		return nil, fmt.Errorf("unknown op %s", op)
	}
	return r, nil
}

func (d *driver) stopAll() {
	for i := len(d.order) - 1; i >= 0; i-- {
		if c, ok := d.clients[d.order[i]]; ok {
			delete(d.clients, d.order[i])
			if err := c.GracefulStop(); err != nil {
				fmt.Fprintln(os.Stderr, "stop", d.order[i], err)
			}
		}
	}
}

func main() {
	endpoint := flag.String("endpoint", "", "broker endpoint host:port")
	flag.Parse()
	// The client logs to files under this root unless told to use the console (stdout, which is ours).
	if os.Getenv("rocketmq.client.logRoot") == "" {
		os.Setenv("rocketmq.client.logRoot", os.TempDir())
	}
	os.Setenv("mq.consoleAppender.enabled", "false")
	rmq.ResetLogger()
	rmq.EnableSsl = false // Go defaults to TLS; lmq listens in plaintext unless given a certificate
	d := &driver{
		config:  &rmq.Config{Endpoint: *endpoint, Credentials: &credentials.SessionCredentials{}},
		clients: map[string]stoppable{},
		handles: map[string][2]any{},
	}
	emit(map[string]any{"event": "ready"})
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 64<<20)
	for in.Scan() {
		if len(in.Bytes()) == 0 {
			continue
		}
		var request map[string]any
		if err := json.Unmarshal(in.Bytes(), &request); err != nil {
			fmt.Fprintln(os.Stderr, "bad request:", err)
			continue
		}
		id, op := request["id"], str(request, "op", "")
		if op == "exit" {
			d.stopAll()
			emit(map[string]any{"id": id, "ok": true})
			os.Exit(0)
		}
		result, err := d.run(op, request)
		if err != nil {
			fmt.Fprintln(os.Stderr, op, "failed:", err)
			var code any
			var status *rmq.ErrRpcStatus
			if errors.As(err, &status) {
				code = status.GetCode()
			}
			emit(map[string]any{"id": id, "ok": false, "error": fmt.Sprintf("%T: %v", err, err), "code": code})
			continue
		}
		result["id"], result["ok"] = id, true
		emit(result)
	}
	d.stopAll()
}
