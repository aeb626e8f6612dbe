//! Structured output on the real model: JSON objects, JSON schemas, Lark
//! and GBNF grammars and regular expressions hold for every sample, greedy
//! and sampled, with and without speculative decoding; bad constraints are
//! refused before anything runs.

use serde_json::{json, Value};
use tessera_engine::{
    Constraint, Engine, EngineConfig, EngineError, FinishReason, GenerateRequest, Message,
    NgramSpec, Prompt, SamplingParams,
};

use super::engine;

fn chat(text: &str) -> Prompt {
    Prompt::Chat(vec![Message::new("user", text)])
}

fn constrained(prompt: Prompt, c: Constraint, sampling: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        sampling,
        max_tokens: 200,
        constraint: Some(c),
        ..GenerateRequest::new(prompt)
    }
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "Lyon", "Nice"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
        },
        "required": ["name", "age", "city", "tags"],
        "additionalProperties": false
    })
}

/// The schema's own checks, by hand (the Python suite validates with
/// `jsonschema`).
fn check_person(v: &Value) {
    let o = v.as_object().expect("an object");
    assert_eq!(o.len(), 4, "{v}");
    assert!(
        o["name"].as_str().is_some_and(|s| s.chars().count() <= 24),
        "{v}"
    );
    assert!(
        o["age"].as_i64().is_some_and(|a| (0..=120).contains(&a)),
        "{v}"
    );
    assert!(
        ["Paris", "Lyon", "Nice"].contains(&o["city"].as_str().unwrap()),
        "{v}"
    );
    let tags = o["tags"].as_array().unwrap();
    assert!(
        tags.len() <= 3
            && tags
                .iter()
                .all(|t| t.as_str().is_some_and(|s| s.chars().count() <= 12))
    );
}

fn run(e: &Engine, req: &GenerateRequest) -> Vec<tessera_engine::Completion> {
    e.complete_n(req, &mut |_| {}).expect("the request runs")
}

#[test]
fn schemas_grammars_and_regexes_hold_for_every_sample() {
    for spec in [None, Some(NgramSpec::default())] {
        let e = engine(EngineConfig {
            speculative: spec,
            ..EngineConfig::default()
        });
        let prompt = chat("Describe a person who lives in France as JSON.");
        let greedy = constrained(
            prompt.clone(),
            Constraint::JsonSchema(person_schema()),
            SamplingParams::greedy(),
        );
        let first = run(&e, &greedy).remove(0);
        assert_eq!(first.finish_reason, FinishReason::Stop, "{}", first.text);
        check_person(&serde_json::from_str(&first.text).expect("valid JSON"));
        // Greedy is reproducible, constrained or not.
        assert_eq!(run(&e, &greedy)[0].tokens, first.tokens);

        let sampled = GenerateRequest {
            n: 3,
            ..constrained(
                prompt,
                Constraint::JsonSchema(person_schema()),
                SamplingParams {
                    temperature: 1.0,
                    seed: 7,
                    ..SamplingParams::default()
                },
            )
        };
        for c in run(&e, &sampled) {
            assert_eq!(c.finish_reason, FinishReason::Stop, "{}", c.text);
            check_person(&serde_json::from_str(&c.text).expect("valid JSON"));
        }

        let obj = run(
            &e,
            &constrained(
                chat("Give me a JSON object about cats."),
                Constraint::JsonObject,
                SamplingParams::greedy(),
            ),
        )
        .remove(0);
        if obj.finish_reason == FinishReason::Stop {
            assert!(
                serde_json::from_str::<Value>(&obj.text)
                    .unwrap()
                    .is_object(),
                "{}",
                obj.text
            );
        }

        let date = run(
            &e,
            &constrained(
                chat("When did the Berlin wall fall?"),
                Constraint::Regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}".into()),
                SamplingParams::greedy(),
            ),
        )
        .remove(0);
        assert_eq!(date.finish_reason, FinishReason::Stop);
        assert_eq!(date.text.len(), 10, "{}", date.text);
        assert!(date
            .text
            .chars()
            .enumerate()
            .all(|(i, c)| if i == 4 || i == 7 {
                c == '-'
            } else {
                c.is_ascii_digit()
            }));

        let gbnf = "root ::= answer \".\"\nanswer ::= \"yes\" | \"no\" | \"maybe\"\n";
        let yes_no = run(
            &e,
            &constrained(
                chat("Is the sea salty?"),
                Constraint::grammar_text(gbnf),
                SamplingParams::greedy(),
            ),
        )
        .remove(0);
        assert!(
            ["yes.", "no.", "maybe."].contains(&yes_no.text.as_str()),
            "{}",
            yes_no.text
        );
    }
}

#[test]
fn bad_constraints_are_refused_with_the_reason() {
    let e = engine(EngineConfig::default());
    for (c, needle) in [
        (Constraint::JsonSchema(json!({"type": "strnig"})), "strnig"),
        (Constraint::Lark("start: foo".into()), "foo"),
        (Constraint::Regex("[a-".into()), "regex"),
    ] {
        let req = constrained(chat("Hi"), c, SamplingParams::greedy());
        match e.generate(req) {
            Err(EngineError::Invalid(why)) => {
                assert!(why.to_lowercase().contains(needle), "{why}")
            }
            Err(other) => panic!("refused with {other}"),
            Ok(_) => panic!("a bad constraint ran"),
        }
    }
    // The engine goes on serving.
    let ok = run(
        &e,
        &constrained(
            chat("Hi"),
            Constraint::Regex("hello|hi".into()),
            SamplingParams::greedy(),
        ),
    );
    assert!(["hello", "hi"].contains(&ok[0].text.as_str()));
}

fn weather_tools() -> Vec<tessera_engine::ToolSpec> {
    [
        json!({"type": "function", "function": {"name": "get_weather", "strict": true,
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}),
        json!({"type": "function", "function": {"name": "get_time",
            "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                "required": ["timezone"]}}}),
    ]
    .iter()
    .map(|t| tessera_engine::ToolSpec::from_openai(t).unwrap())
    .collect()
}

/// `required` and a named function always give calls that parse, on both
/// real models (neither template renders tools: the tools go into a
/// system message, the calls are Hermes-style), sampled. One test per
/// model, so that the two run side by side.
#[test]
fn forced_tool_calls_always_parse_on_smollm2() {
    forced_tool_calls_always_parse(engine(EngineConfig::default()));
}

/// [`forced_tool_calls_always_parse_on_smollm2`] on Gemma 3.
#[test]
fn forced_tool_calls_always_parse_on_gemma3() {
    let gemma = tessera_model::Model::load(
        &super::models_file("gemma-3-270m-q4_k_m.gguf", " gemma3"),
        &mut |_, _| {},
    )
    .unwrap();
    forced_tool_calls_always_parse(Engine::from_model(gemma, EngineConfig::default()).unwrap());
}

fn forced_tool_calls_always_parse(e: Engine) {
    use tessera_engine::{ToolChoice, ToolSyntax};
    let tools = weather_tools();
    let syntax = ToolSyntax::of(&e.model().template, &e.model().tokenizer);
    assert!(!syntax.native);
    for (choice, parallel) in [
        (ToolChoice::Required, true),
        (ToolChoice::Required, false),
        (ToolChoice::Named("get_time".into()), false),
    ] {
        let prompt = syntax.prompt(
            vec![Message::new(
                "user",
                "What is the weather in Oslo, and the time there?",
            )],
            &tools,
        );
        let c = syntax.constraint(&tools, &choice, parallel).unwrap();
        // Room for four calls of the longest arguments the schemas allow.
        let req = GenerateRequest {
            n: 2,
            max_tokens: 800,
            ..constrained(
                prompt,
                c.unwrap(),
                SamplingParams {
                    temperature: 1.0,
                    ..SamplingParams::default()
                },
            )
        };
        for out in run(&e, &req) {
            assert_eq!(out.finish_reason, FinishReason::Stop, "{}", out.text);
            let (_, calls) = syntax.parse(&out.text).expect("the calls parse");
            assert!(!calls.is_empty() && calls.len() <= tessera_engine::MAX_PARALLEL_CALLS);
            if !parallel {
                assert_eq!(calls.len(), 1, "{}", out.text);
            }
            for call in calls {
                let a = call.arguments.as_object().unwrap();
                match call.name.as_str() {
                    "get_weather" => {
                        assert!(matches!(choice, ToolChoice::Required));
                        assert_eq!(a.len(), 2, "strict: no other properties");
                        assert!(["celsius", "fahrenheit"].contains(&a["unit"].as_str().unwrap()));
                    }
                    "get_time" => assert!(a["timezone"].is_string()),
                    other => panic!("called {other}"),
                }
            }
        }
    }
}

/// Gemma's own template (Gemma 2's, from llama.cpp's
/// `models/templates/google-gemma-2-2b-it.jinja`, which Gemma 3's follows
/// turn for turn) on the Gemma 3 weights: the calls are Python calls in a
/// `tool_code` block, the tools head the first user turn (the template
/// refuses a system turn), and forced calls always parse, with earlier
/// calls and results in the history.
#[test]
fn gemma_template_gets_python_tool_calls() {
    use tessera_engine::{ToolChoice, ToolFormat, ToolSyntax};
    const GEMMA: &str = "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}";
    let mut gemma = tessera_model::Model::load(
        &super::models_file("gemma-3-270m-q4_k_m.gguf", " gemma3"),
        &mut |_, _| {},
    )
    .unwrap();
    gemma.template = tessera_model::ChatTemplate::new(GEMMA, "<bos>", "<eos>").unwrap();
    let e = Engine::from_model(gemma, EngineConfig::default()).unwrap();
    let syntax = ToolSyntax::of(&e.model().template, &e.model().tokenizer);
    assert_eq!(
        (syntax.format, syntax.native),
        (ToolFormat::Pythonic, false)
    );
    let tools = weather_tools();
    let mut call = Message::new("assistant", "");
    call.tool_calls = Some(json!([{"id": "c1", "type": "function",
        "function": {"name": "get_time", "arguments": "{\"timezone\": \"CET\"}"}}]));
    let mut result = Message::new("tool", "12:00");
    result.tool_call_id = Some("c1".into());
    for (choice, parallel) in [
        (ToolChoice::Required, true),
        (ToolChoice::Named("get_weather".into()), false),
    ] {
        let prompt = syntax.prompt(
            vec![
                Message::new("user", "What time is it in Oslo, and the weather?"),
                call.clone(),
                result.clone(),
            ],
            &tools,
        );
        let text = e
            .tokenize_prompt(&prompt)
            .map(|ids| e.model().tokenizer.decode(&ids).unwrap());
        let text = text.expect("the template renders the conversation");
        assert!(
            text.contains("```tool_code\n[get_time(timezone=\"CET\")]\n```"),
            "{text}"
        );
        assert!(text.contains("```tool_output\n12:00\n```"), "{text}");
        let c = syntax
            .constraint(&tools, &choice, parallel)
            .unwrap()
            .unwrap();
        let req = GenerateRequest {
            n: 2,
            max_tokens: 400,
            ..constrained(
                prompt,
                c,
                SamplingParams {
                    temperature: 1.0,
                    ..SamplingParams::default()
                },
            )
        };
        for out in run(&e, &req) {
            assert_eq!(out.finish_reason, FinishReason::Stop, "{}", out.text);
            assert!(out.text.starts_with("```tool_code\n["), "{}", out.text);
            let (_, calls) = syntax.parse(&out.text).expect("the calls parse");
            assert!(!calls.is_empty() && calls.len() <= tessera_engine::MAX_PARALLEL_CALLS);
            for c in calls {
                let a = c.arguments.as_object().unwrap();
                match c.name.as_str() {
                    "get_weather" => assert_eq!(a.len(), 2, "{}", out.text),
                    "get_time" => assert!(matches!(choice, ToolChoice::Required)),
                    other => panic!("called {other}"),
                }
            }
        }
    }
}

/// A lazy constraint ([`Constraint::After`]) leaves the answer free (the
/// tokens of a plain run) until its trigger appears, then holds the rest
/// to its grammar; a trigger that never appears, or one whose grammar the
/// text after it cannot fit, changes nothing. Under `tool_choice: auto`
/// (the trigger a call's opening marker), every answer that opens a call
/// gives calls that parse.
#[test]
fn auto_tool_calls_are_held_to_their_syntax_once_opened() {
    use tessera_engine::{ToolChoice, ToolSyntax};
    let e = engine(EngineConfig::default());
    let ask = |c: Option<Constraint>| {
        let req = GenerateRequest {
            sampling: SamplingParams::greedy(),
            max_tokens: 40,
            constraint: c,
            ..GenerateRequest::new(chat("What is the capital of France?"))
        };
        run(&e, &req).remove(0)
    };
    let plain = ask(None);
    // The plain answer's third word as the trigger, then three two-digit
    // numbers and a full stop.
    let word = plain.text.split_whitespace().nth(2).expect("a few words");
    let word: String = word.chars().filter(|c| c.is_alphabetic()).collect();
    let at = plain.text.find(&word).unwrap() + word.len();
    let lazy = |then: String| Constraint::After {
        trigger: word.clone(),
        token: None,
        then: Box::new(Constraint::Regex(then)),
    };
    let out = ask(Some(lazy(format!("{word}( [0-9]{{2}}){{3}}\\."))));
    assert_eq!(out.finish_reason, FinishReason::Stop, "{}", out.text);
    assert_eq!(out.text[..at], plain.text[..at], "free until the trigger");
    let tail = &out.text.as_bytes()[at..];
    assert_eq!(tail.len(), 10, "{}", out.text);
    for (i, b) in tail.iter().enumerate() {
        match i {
            0 | 3 | 6 => assert_eq!(*b, b' ', "{}", out.text),
            9 => assert_eq!(*b, b'.', "{}", out.text),
            _ => assert!(b.is_ascii_digit(), "{}", out.text),
        }
    }
    // Never triggered, or not fitting: the plain answer.
    let absent = Constraint::After {
        trigger: "zebra crossing".into(),
        token: None,
        then: Box::new(Constraint::Regex("zebra crossing[0-9]".into())),
    };
    assert_eq!(ask(Some(absent)).text, plain.text);
    assert_eq!(ask(Some(lazy("xyz[0-9]".into()))).text, plain.text);

    let tools = weather_tools();
    let syntax = ToolSyntax::of(&e.model().template, &e.model().tokenizer);
    let auto = syntax
        .constraint(&tools, &ToolChoice::Auto, true)
        .unwrap()
        .expect("a lazy constraint");
    assert!(matches!(&auto, Constraint::After { trigger, .. } if trigger == syntax.opener()));
    // The 135M model does not open calls of its own under `auto` (it
    // answers in prose); a bias towards the opening marker's tokens stands
    // for a model that does. Once opened, every answer is calls that parse
    // (the bias stays on, and the grammar holds it to the syntax).
    let opener = e
        .model()
        .tokenizer
        .encode(syntax.opener(), tessera_model::Special::Parse, false)
        .unwrap();
    let req = GenerateRequest {
        n: 4,
        max_tokens: 600,
        ..constrained(
            syntax.prompt(
                vec![Message::new(
                    "user",
                    "What is the weather in Oslo right now?",
                )],
                &tools,
            ),
            auto,
            SamplingParams {
                temperature: 1.0,
                seed: 7,
                logit_bias: opener.iter().map(|&t| (t, 12.0)).collect(),
                ..SamplingParams::default()
            },
        )
    };
    for out in run(&e, &req) {
        assert!(out.text.contains(syntax.opener()), "{}", out.text);
        assert_eq!(out.finish_reason, FinishReason::Stop, "{}", out.text);
        let (_, calls) = syntax.parse(&out.text).expect("the calls parse");
        assert!(!calls.is_empty(), "{}", out.text);
    }
}
