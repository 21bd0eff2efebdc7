// Renders an Ollama Modelfile TEMPLATE with Go's own text/template, on the data Ollama gives
// a template (github.com/ollama/ollama template/template.go and api/types.go, restated here
// because Ollama itself is not installable on these machines):
//
//	.System    the system messages, joined by "\n\n" (Ollama's collate)
//	.Messages  the messages, consecutive ones of one role merged (tool results excepted),
//	           each with .Role, .Content, .Thinking, .ToolCalls (.Function.Name,
//	           .Function.Arguments), .ToolName
//	.Tools     the tools (.Type, .Function with .Name, .Description, .Parameters)
//	.Think, .IsThinkSet   Ollama's think option
//	json       Ollama's one template function that the exported templates use
//
// Input (stdin): {"template": "...", "messages": [OpenAI-shaped messages, with
// "reasoning_content" as Ollama's thinking], "tools": [...], "think": null|true|false}.
// Output (stdout): the rendering. Used by tests/e2e/test_export.py.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"text/template"
)

type ToolCallFunction struct {
	Index     int            `json:"index"`
	Name      string         `json:"name"`
	Arguments map[string]any `json:"arguments"`
}

type ToolCall struct {
	Function ToolCallFunction `json:"function"`
}

type Message struct {
	Role      string     `json:"role"`
	Content   string     `json:"content"`
	Thinking  string     `json:"thinking,omitempty"`
	ToolCalls []ToolCall `json:"tool_calls,omitempty"`
	ToolName  string     `json:"tool_name,omitempty"`
}

type ToolFunction struct {
	Name        string `json:"name"`
	Description string `json:"description,omitempty"`
	Parameters  any    `json:"parameters"`
}

// String as Ollama's: templates print {{ .Function }} as JSON.
func (f ToolFunction) String() string {
	b, _ := json.Marshal(f)
	return string(b)
}

type Tool struct {
	Type     string       `json:"type"`
	Function ToolFunction `json:"function"`
}

type input struct {
	Template string `json:"template"`
	Messages []struct {
		Role             string `json:"role"`
		Content          string `json:"content"`
		ReasoningContent string `json:"reasoning_content"`
		Name             string `json:"name"`
		ToolCalls        []struct {
			Function struct {
				Name      string          `json:"name"`
				Arguments json.RawMessage `json:"arguments"`
			} `json:"function"`
		} `json:"tool_calls"`
	} `json:"messages"`
	Tools []Tool `json:"tools"`
	Think *bool  `json:"think"`
}

// collate: as Ollama's (template/template.go).
func collate(msgs []Message) (string, []*Message) {
	var system []string
	var collated []*Message
	for i := range msgs {
		if msgs[i].Role == "system" {
			system = append(system, msgs[i].Content)
		}
		if len(collated) > 0 && collated[len(collated)-1].Role == msgs[i].Role && msgs[i].Role != "tool" {
			collated[len(collated)-1].Content += "\n\n" + msgs[i].Content
		} else {
			collated = append(collated, &msgs[i])
		}
	}
	return strings.Join(system, "\n\n"), collated
}

func main() {
	raw, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail(err)
	}
	var in input
	if err := json.Unmarshal(raw, &in); err != nil {
		fail(err)
	}
	var msgs []Message
	for _, m := range in.Messages {
		msg := Message{Role: m.Role, Content: m.Content, Thinking: m.ReasoningContent, ToolName: m.Name}
		for i, c := range m.ToolCalls {
			args := map[string]any{}
			var s string
			if json.Unmarshal(c.Function.Arguments, &s) == nil { // arguments as a JSON string
				if err := json.Unmarshal([]byte(s), &args); err != nil {
					fail(err)
				}
			} else if err := json.Unmarshal(c.Function.Arguments, &args); err != nil {
				fail(err)
			}
			msg.ToolCalls = append(msg.ToolCalls, ToolCall{ToolCallFunction{i, c.Function.Name, args}})
		}
		msgs = append(msgs, msg)
	}
	funcs := template.FuncMap{
		"json": func(v any) string {
			b, _ := json.Marshal(v)
			return string(b)
		},
	}
	t, err := template.New("").Option("missingkey=zero").Funcs(funcs).Parse(in.Template)
	if err != nil {
		fail(err)
	}
	system, collated := collate(msgs)
	data := map[string]any{
		"System":     system,
		"Messages":   collated,
		"Tools":      in.Tools,
		"Response":   "",
		"Think":      in.Think != nil && *in.Think,
		"IsThinkSet": in.Think != nil,
	}
	if err := t.Execute(os.Stdout, data); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}
