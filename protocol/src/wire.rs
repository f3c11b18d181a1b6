//! Borrowed pieces for decoding frames without copying what is only looked at.
//!
//! A frame is decoded once per gateway frame, thousands of times per second: a field that is only
//! compared or type-checked (the frame kind, the event name, a chat message's role) is borrowed
//! from the frame's text instead of copied (a string with escapes is the exception: it has to be
//! unescaped into a copy). Type checks are those of the owned types they replace: a field that
//! must be a string and is not still fails the frame.

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use std::borrow::Cow;
use std::fmt;

/// A JSON string, borrowed from the input when it has no escapes. (`Option<Cow<str>>` is always
/// an owned copy with serde, even with `#[serde(borrow)]`.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Str<'a>(pub Cow<'a, str>);

impl<'a> Str<'a> {
    /// The string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// An owned copy.
    pub fn into_owned(self) -> String {
        self.0.into_owned()
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Str<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V(std::marker::PhantomData))
    }
}

/// One content block of a chat message, borrowed: only `text` blocks matter, and only their text.
#[derive(Deserialize)]
struct Block<'a> {
    /// Only `text` blocks are streamed; required, as it always was.
    #[serde(rename = "type", borrow)]
    kind: Str<'a>,
    /// The block's text, appended to the message's text (borrowed: copied once, there).
    #[serde(default, borrow)]
    text: Option<Str<'a>>,
}

/// A chat message's content reduced to its text while it is decoded: a plain string as it is, or
/// the text of all `text` blocks of a block list, concatenated. Anything else fails, as the
/// content's full decoding did (a list whose block lacks its `type`, a number, `null`).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ContentText(pub String);

impl<'de> Deserialize<'de> for ContentText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ContentText;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of content blocks or a string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ContentText(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(ContentText(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = String::new();
                while let Some(block) = seq.next_element::<Block<'de>>()? {
                    if block.kind.as_str() == "text" {
                        if let Some(t) = &block.text {
                            out.push_str(t.as_str());
                        }
                    }
                }
                Ok(ContentText(out))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct S<'a> {
        #[serde(borrow)]
        s: Option<Str<'a>>,
    }

    #[test]
    fn borrows_plain_strings_and_unescapes_others() {
        let plain: S<'_> = serde_json::from_str(r#"{"s":"abc"}"#).expect("decodes");
        assert!(matches!(plain.s, Some(Str(Cow::Borrowed("abc")))));
        let escaped: S<'_> = serde_json::from_str(r#"{"s":"a\"b\u00e9"}"#).expect("decodes");
        assert!(matches!(escaped.s, Some(Str(Cow::Owned(ref s))) if s == "a\"bé"));
        let null: S<'_> = serde_json::from_str(r#"{"s":null}"#).expect("decodes");
        assert_eq!(null.s, None);
        for bad in ["1", "[]", "{}", "true"] {
            assert!(serde_json::from_str::<S<'_>>(&format!(r#"{{"s":{bad}}}"#)).is_err(), "{bad}");
        }
    }

    #[test]
    fn content_text_joins_text_blocks_and_refuses_the_rest() {
        let t = |v: &str| serde_json::from_str::<ContentText>(v).map(|c| c.0);
        assert_eq!(t(r#"[{"type":"text","text":"a"},{"type":"thinking","text":"x"},{"type":"text"},{"type":"text","text":"b"}]"#).ok().as_deref(), Some("ab"));
        assert_eq!(t(r#""plain""#).ok().as_deref(), Some("plain"));
        assert_eq!(t("[]").ok().as_deref(), Some(""));
        for bad in ["null", "1", r#"[{"text":"a"}]"#, r#"[{"type":1}]"#, r#"[{"type":"text","text":2}]"#, "{}"] {
            assert!(t(bad).is_err(), "{bad}");
        }
    }
}
