"""The rule judge: English patterns for corrections, thanks and tool errors (METHOD.md §2).

Boundary: tables of regexes and the few lines that weigh them; text in, a Verdict (or None
when unsure, so the caller can hand the turn to an LLM judge) and the user's own correction
out. No model, no I/O. The judge's shared types and prompt helpers live in clawd/judge.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clawd.judge import MIN_HINT_CHARS, JudgeInput, Verdict, _last_user_index, _message_text

# Tables, not logic: each entry is one regex over the normalised (lower-case, straight
# apostrophes) text. Precedence: STRONG corrections beat approval ("thanks, but that's
# wrong" is -1); WEAK corrections lose to approval ("no, that's perfect" is +1); HOLD cues
# and "approval ... but" leave the turn undecided for the LLM judge.


def _rx(*patterns: str) -> list[re.Pattern]:
    return [re.compile(p) for p in patterns]


# Phrases that contain a cue word but mean no harm; blanked out before matching.
NEUTRAL = _rx(
    r"\bno (problem|worries|worry|stress)\b",
    r"\bno,? thanks?( you)?\b",
    r"\bno,? thank you\b",
    r"\bdon'?t (worry|mind)\b",
    r"\bi (don'?t|do not) know\b",
    r"\bnot (wrong|incorrect)\b",
    r"\b(nothing|anything|what'?s|what is|what was|something|what went|what goes) (is |was |went |goes )?wrong\b",
    r"\bdon'?t need anything (else|more)\b",
    r"\bdon'?t change (a thing|anything)\b",
    r"\b(can'?t|couldn'?t) (complain|thank you enough|be happier)\b",
    r"\bno longer\b",
    r"\bno (errors?|issues?|bugs?|problems?)\b",
    # owning up to one's own mistake is thanks, not a complaint
    r"\b(i|we) (always |often |keep |usually |sometimes )?(made|make|making)( this| that| the same| a)? mistakes?\b",
    r"\bmy (mistake|bad|typo)\b",
    r"\bhow exactly\b",
    # asking how to say something in a language is a new request, not a language complaint
    r"\bhow (do (i|you) |to |would (i|you) |can i )?(say|write|spell|translate)\b.*",
    # "can I use oat milk instead?", "if they're warm rather than cold, should I...?": the user
    # asks about their own options; "could YOU use X instead" stays a change request
    # ("could I get it in metric instead?" and "can we use a table instead?" ask the assistant)
    r"\b(can|should|shall|may|do) i (?!ask you)[^.!?]*\b(instead|rather than)\b[^.!?]*\?",
    r"\bif [^.!?]*\b(instead|rather than)\b[^.!?]*,\s*(should|can|do) i\b[^.!?]*\?",
    # how-to questions about the user's own task: "how do I sort it in reverse order?"
    r"\bhow (do|can|should) (i|we) [^.!?]*\?",
    # the user's own plans: "we're going to redo the kitchen floor" ("we need to start over" is a complaint)
    r"\b(i|we)('m|'re| am| are)?( also| finally| just)? (going to|gonna|will|plan to|planning to)"
    r" (redo|re-do|rewrite|start over)\b",
)

STRONG = _rx(
    # outright rejection
    r"\b(that'?s|that is|this is|it'?s|it is|you'?re|you are|you got( it)?|still|all|completely|totally"
    r"|is|are|was|were|answer is|seems?|looks?) (\w+ )?(wrong|incorrect|inaccurate|false|not right|not correct)\b",
    r"^\W*(wrong|incorrect|not right|not correct)\b",
    r"\bwrong (answer|result|number|language|file|format|one"
    r"|approach|unit|units|date|name|value|output|version|library|function|method|word|way)\b",
    r"\bnot (what|the (one|thing|answer|result|format|point))\b",
    r"^\W*not (it|really|exactly|quite)\b",
    r"\bnot quite\b",
    r"\bclose,? but\b",
    r"\w, not (?!bad\b|only\b|just\b|sure\b|yet\b|too\b|that\b|to\b)\w",
    r"\b(that|this|it) (isn'?t|is not|wasn'?t|was not) (it|right|correct|true|accurate|what|helpful|useful)\b",
    r"\bi (don'?t|do not) think (that|this|it)('?s| is| was)? (right|correct|true|accurate)\b",
    r"\b(mistake|typo|mistakes|typos)\b",
    r"\bthanks for nothing\b",
    r"\bmakes no sense\b",
    r"\bnonsense\b",
    r"\b(useless|unhelpful)\b",
    # "I meant", "I asked", rephrasings
    r"(?<!what )(?<!exactly )\bi meant\b",
    r"\bwhat i meant (was|is)\b",
    r"\bi (was )?(asked|asking) (for|about|you)\b",
    r"\bi said\b",
    r"(?<!what )\bi wanted\b",
    r"\bi (never|didn'?t|did not) (ask|say|said|want|request)\b",
    r"\blet me (rephrase|clarify|be clearer|try again)\b",
    r"\bin other words\b",
    r"\bto (clarify|be clear)\b",
    r"\bmy question (is|was)\b",
    r"\bread (my|the) (question|message|request) again\b",
    r"\b(you )?(misunderstood|misread|misunderstand)\b",
    # redo
    r"\b(rewrite|reword|rephrase|reformat|redo|re-do|regenerate|retry|start over|try again|do it again"
    r"|do that again|one more time)\b",
    r"\bgive it another (try|shot|go)\b",
    r"\banother (try|attempt)\b",
    # it does not work
    r"\b(doesn'?t|does not|didn'?t|did not|won'?t|will not|isn'?t|is not|wasn'?t|can'?t|cannot)"
    r" (work|compile|run|build|help|answer|load|start|fix|solve|make sense|exist|match|render|display|show up"
    r"|look right|seem right|seem correct|do what)\b",
    r"\bnot working\b",
    r"\b(it|this|that|the code|the script|the app|the test|the tests|tests|the build"
    r"|the page|the link|the command) (still )?(fails|failed|failing|crashes|crashed|crashing|breaks|broke"
    r"|hangs|hung|errors|errored)\b",
    r"\bbroken\b",
    r"\b(get|got|getting|see|seeing|throws?|threw|raises?|raised|gives?|gave|giving|shows?|showed)\b[^.!?]{0,25}"
    r"(error|exception|traceback|segfault|stack trace)\b",
    r"traceback \(most recent call last\)",
    r"\b\w+(error|exception): ",
    r"\b(there'?s|there is|there are|has|have|got|found) (a|an|another|one|some|two|several) (\w+ )?"
    r"(bug|bugs|error|errors|problem|issue)\b",
    # something missing or ignored
    r"\byou (forgot|missed|left out|skipped|omitted|ignored|didn'?t|did not|never|haven'?t|have not"
    r"|can'?t|still)\b",
    r"\b(is|are|'s|'re|still) missing\b",
    r"^\W*missing\b",
    r"\b(it|that|this|the \w+|which|there|you|answer|response) (should|shouldn'?t|should not|must|needs to|has to)"
    # not "work"/"do": "that should work, thanks" is approval
    r" (be|have|use|say|return|not|include|contain|go|mention|handle|ignore|support|show|print|sound|read"
    r"|start|end|only|stay|match|accept|take|list|explain|cover)\b",
    r"\bshould(n'?t)? have\b",
    r"\bshould'?ve\b",
    r"\bsupposed to\b",
    r"\byou (should|need to|have to|must)\b",
    # change requests
    r"\bchange\b[^.!?]{0,40}\bto\b",
    r"\bchange (it|that|this|the)\b",
    r"\breplace\b[^.!?]{0,40}\bwith\b",
    r"\bswitch\b[^.!?]{0,40}\bto\b",
    r"\binstead\b",
    r"\brather than\b",
    r"\bfix (it|this|that)\b",
    r"\b(make|keep|write|rewrite|reword|phrase|give|get) (it|this|that|them|these|those|the( \w+){0,2}?"
    r"|your( \w+)? (answer|reply|response)) (a (bit|little|lot) |much |way |even |slightly )?"
    r"(more|less|shorter|longer|simpler|clearer|smaller|bigger|faster|cleaner|friendlier|warmer|funnier|easier"
    r"|briefer|tighter)\b",
    r"\bbe (a (bit|little|lot) |much |way )?(more|less) (?!(my|your|his|her|our|their|of|than|like)\b)\w+",
    r"(^|[.!?]\s*)(a (bit|little|lot) )?(more|less) "
    r"(?!of\b|please\b|than\b|importantly\b|or\b|and\b|likely\b)\w+",
    r"\b(shorter|briefer|terser|simpler|more concise|less verbose|less wordy)\b",
    r"\btoo (long|short|verbose|wordy|formal|informal|casual|complicated|complex|technical|simple|basic|vague"
    r"|generic|repetitive|much|many|slow|big|small|robotic|stiff|dense|brief|terse|lengthy|detailed|advanced"
    r"|cheesy|boring|bland|harsh|cold|dry|academic|fancy|flowery)\b",
    r"\bwould be (great|nice|good|better|helpful) if\b",
    r"\bit'?d be (great|nice|good|better)\b",
    r"\bwithout (the|any|all|those|these)\b",
    r"\bno more\b",
    r"\bget rid of\b",
    r"\bno (bullet|bold|lists?|emojis?|markdown|headers|headings|jargon|intro|preamble|apolog)",
    # imperative don't / never / stop
    r"(^|[.!?;,:]\s*|\b(please|pls|and|but|also|just|so|ok|okay|then|again|seriously)\s+)"
    r"(don'?t|do not|never)\s+(?!mind\b)\w+",
    r"\b(stop|quit) (using|adding|putting|writing|saying|doing|making|being|with|giving|apologi\w*|repeating"
    r"|including|it|that)\b",
    r"\bi (don'?t|do not) (like|want|need)\b",
    r"\bi (hate|dislike)\b",
    r"👎|😡|🙄|😤",
    # "thanks, but ..." is a reservation that asks for a change, unless the user just moves on
    r"^\W*((hmm+|ok|okay|well)\W+)?(thanks|thank you|thx|ty|nice|great|good|cool|perfect|lovely|looks good)\W*"
    r"(but|though|however)\b"
    r"(?!\W+(actually|i'?ll|i will|i'?m|i am|i won'?t|we'?ll|i ended|i think i'?ll))",
    # a standing preference: it names the future
    r"\b(next time|from now on|in (the )?future|going forward|every time)\b",
    r"\bfrom now,? (please|pls|only|just|always|never)\b",
    r"\bstay in (character|role)\b",
    r"\b(up ?front|at the (top|start|beginning))\b[^.!?]{0,20}$|\bput [^.!?]{0,30}\b(up ?front|first|at the (top|start))\b",
    r"\blead with\b",
    r"\bsign (it|off|them|the \w+)\b",
    r"(^|[.!?]\s*)stop\b",
    r"(^|[.!?,;]\s*|\b(please|pls|just|can|could|and|so|now)\s+)(stop|quit) \w+ing\b",
    r"(^|[.!?,;]\s*|\b(i|we|i'?ve|we'?ve) )already (did|tried|done|have|said|told)\b",
    r"\byou (don'?t|do not) (need|have) (to|the|those|these|that|all|any)\b",
    r"\bdo you (really|seriously) think\b",
    r"\b(old|outdated|out of date|out-of-date|stale) (information|info|data|numbers|figures)\b",
    r"\b(that'?s|that is|it'?s|this is) (off|way off|not it)\b",
    r"\bcorrect (it|that|this|them)\b",
    r"\bwrite (it |them |my \w+ )?correct(ly)?\b",
    r"\b(please|pls) no \w+",
    r"\b(please|pls),? (a (bit|little|lot) )?(more|less) \w+",
    r"\bsomething (a (bit|little|lot) )?(more|less) \w+",
    r"\b(is|it'?s|that'?s|was|far|way|bit|little|much|are|sounds?|reads?|looks?|seems?) too \w+",
    r"\bexcept (that|it|this|the|you)\b",
    r"\bnow it (reads|sounds|looks|feels) like\b",
    r"^\W*not (in|as|like|the|a|an|by)\b",
    r"\bbe (a (bit|little|lot) |much |way )?\w{3,}er\b(?<!\bbetter)(?<!\bever)(?<!\bover)",
    # sarcasm markers: praise that means the opposite
    r"^\W*(ah|oh) (yes|sure|great|right|wonderful)\b",
    r"\bfamous(ly)?\b[^.!?]{0,40}\b(known as|measured|format)\b|\bfamously\b",
    r"\bvery \w+ of you\b",
    r"\bwhat year is it\b",
    r"\b(a|the) whole (lecture|essay|novel|book|speech|sermon|saga)\b",
    r"\ball i (needed|wanted|asked for|asked) (was|is)\b",
    r"^\W*sure,? if you\b",
)


# A leading "no" is a correction, unless it answers the assistant's own question.
_NO_LEAD = re.compile(r"^\W*((hmm+|uh+|um+|ugh+|well|erm|sorry)\W+)?(no|nope|nah|nop)\b")
WEAK = _rx(
    r"^\W*actually\b",
    r"^\W*i mean\b",
    r"\b(remove|delete|drop|cut|lose|skip) (the|all|those|these|that|this|it|them|your)\b",
    r"^\W*(ugh+|meh)\b",
    # a polite request to change what was just given ("could you flip it", "can you use British spelling")
    r"\b(could|can|would) you (please |pls )?(also |just |maybe )?(give|write|make|put|flip|reverse|sort|order|format"
    r"|convert|translate|redo|shorten|change|list|show|split|move|turn|do|present|send|keep|use|lead|add|be|drop"
    r"|remove|calculate|check|stick|spell|switch|answer|respond|reply|go|address|lay|squeeze|condense|tighten"
    r"|rename|reorder)\b"
    r"(?=[^.!?]*\b(it|that|this|them|those|these|the same|the order|your|instead|in|as|with|to)\b)",
    r"\b(could|can|would) you (please |pls )?(also |just |maybe )?(use|lead|keep|stick|switch|spell|be|drop|remove)\b",
    r"\b(could|can|would) you (please |pls )?add [^.!?]{1,40}\b(please|pls)\b",
    # a language asked for by name, also in that language ("en español", "em português")
    r"\b(in|en|em|auf|into) (english|spanish|español|espanol|french|français|francais|anglais|italian|italiano"
    r"|german|deutsch|portuguese|português|portugues|dutch|japanese|chinese|russian|polish|korean|arabic|hindi"
    r"|turkish|swedish|greek)\b",
    # "<the fix>, please": a bare noun phrase asked for politely ("Italian, please." "snake_case pls")
    r"(^|[.!?]\s+)(?!(write|tell|help|explain|what|how|why|who|when|where|which|can|could|and|now|next)\b)"
    r"[^.!?,\s]+( [^.!?,\s]+){0,3},? (please|pls|plz|por favor)\W*$",
    r"\b(please|pls) (in|with|as|first|use|no|write|put|add|keep)\b",
    r"(^|[.!?]\s*)(just|only) (give|check|use|tell|do|answer|say|show|calculate|write|the|list)\b",
    r"\b(can|could) you just\b",
    r"^\W*why (on earth |in the world |the hell )?(are|did|do|would|is|does) you\b",
    r"\bwhy (is|are) (it|this|that|everything) suddenly\b",
    r"\b(please|pls) (rename|shorten|drop|remove|convert|switch|reorder|reformat) (it|that|them|those|these"
    r"|the (?!next\b)\w+)\b",
    # the layout asked for by name: "as a table", "into a numbered list"
    r"\b(as|into) (a )?(table|numbered list|bulleted list|bullet list|bullet points|checklist)\b",
    # an order asked for: "cheapest first", "backwards"
    r"\b(soonest|earliest|latest|cheapest|dearest|oldest|newest|biggest|smallest|highest|lowest|shortest|longest"
    r"|closest|nearest) first\b",
    r"(^|[.!?]\s*)(backwards|the other way (round|around)|(in )?reverse order)\b",
    # a name spelled out letter by letter corrects its spelling
    r"\b[a-z](-[a-z]){3,}\b",
    # a unit asked for with a bare question: "kilometres?"
    r"^\W*(in )?(kilomet(re|er)s|km|celsius|fahrenheit|metric|imperial|miles|grams|kilos|kg|pounds|lbs|ounces"
    r"|litres|liters|cups|inches|centimet(re|er)s|cm|feet|metres|meters)\W*\?\W*$",
    r"\bkeep (it|them|the \w+|your \w+)\b(?! up\b)",
    r"\bput (the|it|that|this|them) [^.!?]{0,20}\b(in|into|at|on)\b",
    r"\b(at|in) the end\b",
    r"\badd (that|this|it|them|the)\b",
    r"(^|[.!?]\s*)we (spell|write|say|use|call|always)\b",
    r"\bsomething else\b",
    r"\bi (believe|think) (it|that|the \w+)( \w+)? (was|is|were|are)\b",
)

# The WEAK cues that only mean something where a message opens ("actually, …", "ugh"): after a
# "but" they are no request.
WEAK_OPENINGS = [p for p in WEAK if p.pattern.startswith("^")]

# "are you sure?" challenges the answer without saying it is wrong: often the user just checks.
HOLD = _rx(r"\bnever ?mind\b", r"\bforget (it|that)\b", r"\bare you sure\b")

APPROVAL = _rx(
    r"\b(thanks|thank (you|u)|thx|thnx|tysm|ty|cheers|ta|much appreciated|appreciate (it|that|this|the help|you))\b",
    r"\b(perfect|excellent|awesome|amazing|brilliant|fantastic|wonderful|superb|great|nice|cool|sweet|neat"
    r"|lovely|exactly|outstanding|beautiful|impressive|helpful|lifesaver|legend|genius)\b",
    r"\b(that|this|it) (works|worked|did it|did the trick|fixed it|helps|helped|solved it|is correct"
    r"|was correct|is right|was right)\b",
    r"\bworks (now|great|perfectly|fine|well|nicely|like a charm)\b",
    r"\b(that'?s|that is|you'?re|you are) (right|correct|spot on|it exactly)\b",
    r"\bspot on\b",
    r"\bnailed it\b",
    r"\blove (it|this|that)\b",
    r"\b(looks|sounds|seems) (good|great|right|fine|perfect)\b",
    r"\blgtm\b",
    r"\b(good|nice|great) (job|work|answer|stuff|one)\b",
    r"\bwell done\b",
    r"\bmakes sense\b",
    r"\bgot it\b",
    r"\bjust what i (needed|wanted|was looking for)\b",
    r"^\W*(good|very good|all good|not bad)\b",
    r"\bthat'?s (good|fine|better|much better)\b",
    r"\bnot bad\b",
    r"\bno (complaints|notes)\b",
    r"\bcan'?t (fault|argue with) (it|that|this)\b",
    r"^\W*that'?ll do\b",
    r"\bdid the trick\b",
    r"\b(tests?|build|it|everything) pass(es|ed)? now\b",
    r"^\W*works\b|\b(formula|code|script|query|fix|command|it|that|this) works\b",
    r"\b(loved|liked|enjoyed) it\b",
    r"\bimpressed\b",
    r"^\W*(yep|yup|yes|yeah)\b",
    r"\bis good\b(?!\s+\w)",
    r"👍|🙏|👌|🎉|❤️|❤|😊|🙂|😀|😄|💯|🔥|🥳|✅",
)

# A message that opens by changing the subject: the change requests in it ("a shorter name for
# the network", "redo the kitchen floor") are about the new subject, not the answer.
_NEW_SUBJECT = re.compile(
    r"^\W*((totally |completely )?(different|separate|unrelated|new) (topic|question|thing|subject|q|note|matter)\b"
    r"|(another|other|next) (topic|question|subject|q)\b|(totally |completely )?unrelated\b|not related\b"
    r"|switching (topics|gears|subjects)\b|changing (the )?subject\b|on an? (different|separate|unrelated|side) note\b)"
)
# The user owns the slip ("oops, I meant Tuesday", "I pasted the old snippet"): what they fix is
# their own message, not the answer ("whoops, that's not what I asked" and "not my mistake" blame
# the answer, so neither counts).
_OWN_SLIP = re.compile(
    r"^\W*(oops|whoops),? (i|my)\b|(?<!not )(?<!n't )\bmy (mistake|bad|typo)\b|\bi (made|make) a (mistake|typo)\b"
    r"|\bi (pasted|copied|sent|gave you|typed|attached) the (old|wrong)\b"
)
# After "but" the user may describe their own plan ("thanks, but I'll keep it as is"): no request.
_OWN_PLAN = re.compile(r"^\W*(i'?ll|i will|i'?m going to|i am going to|we'?ll|we will|i'?d rather)\b")
# Quoted text is the user citing someone ("there's the 'Hope this helps!' again"), not praising.
_QUOTED = re.compile(r"(?<!\w)'[^'\n]{2,80}'(?!\w)|\"[^\"\n]{2,80}\"|‘[^’\n]{2,80}’|“[^”\n]{2,80}”")
# Approval followed by "but" is a reservation, not a verdict.
_RESERVATION = re.compile(r"\b(but|however|though|although|except)\b")
# "now", "next": the user moves on; a "but" after it qualifies the new request, not the answer.
_MOVING_ON = re.compile(r"\b(now|next|then)\b")
_NEGATORS = {"not", "no", "never", "hardly", "barely", "nothing", "far", "nor", "without"}

# Tool results (METHOD §2: a tool error is -1, a success +1). Matched on the original
# case: a tool may return source code, where `error: str` or `failed = []` is no error.
TOOL_NEUTRAL = _rx(
    r"(?i)\b(0|no|zero|without( any)?) (errors?|failures?|failed|exceptions?|issues?)\b",
    r"(?i)\b(errors?|failures?|failed)\s*[:=]\s*0\b",
    r"(?i)\berror[_ ]?(code|count)\s*[:=]\s*0\b",
    r"(?i)\"(is_)?error\"\s*:\s*(null|none|false|\"\"|\[\]|\{\}|0)",
)
TOOL_ERROR = _rx(
    r"(?i)traceback \(most recent call last\)",
    # a line-start marker, but not code: `error = ...`, `error: str`, `error: ClawdError | None`
    r"(?m)^\s*(Error|ERROR|error|Fatal|FATAL|fatal|Failed|FAILED|failed|Failure|FAILURE|Exception|panic)\b"
    r"(?![^\n]*=)(?!\s*[(.\[])(?!\s*:\s*((str|int|bool|float|dict|list|Optional|None)\b|[A-Z]\w*\s*([|\[,]|$)))",
    r"(?m)^\s*[\w.]*[A-Z]\w*(Error|Exception)\s*:",
    r"(?im)^\s*\[(error|fatal)\]",
    r"(?i)\bnpm err!",
    r"(?i)\b(fatal|syntax|runtime|internal|unexpected|unhandled|uncaught) (error|exception)\b",
    r"(?i)\ban? (\w+ )?(error|exception) (occurred|occured|has occurred|was raised|was thrown)\b",
    r"(?i)\b(raised|threw|thrown) an? (\w+ )?exception\b",
    r"(?i)\bfailed\b(?!\s*[=(.\[:])",
    r"(?i)\b(command not found|no such file or directory|permission denied|segmentation fault|core dumped"
    r"|timed out|connection refused|not recognized as an internal or external command|access denied)\b",
    r"(?i)\b(exit(ed)?( with)?( code| status)?|return ?code|returncode|exit_code)\s*[:=]?\s*-?[1-9]\d*\b",
    r"(?i)\brc\s*[:=]\s*-?[1-9]\d*\b",
    r"(?i)\b(4\d\d|5\d\d) (not found|bad request|unauthorized|forbidden|internal server error"
    r"|service unavailable|bad gateway|gateway timeout)\b",
    r"(?i)\bhttp(/[\d.]+)? (4\d\d|5\d\d)\b",
    r"(?i)\"?status(_code)?\"?\s*[:=]\s*(4\d\d|5\d\d)\b",
    r"(?i)\"(is_)?error\"\s*:\s*(true|\"[^\"]+\"|\{)",
    r"(?i)\"status\"\s*:\s*\"(error|failed|failure)\"",
)

# Failures on the server's side, not the call's: the response did nothing wrong (0, undecided).
TOOL_TRANSIENT = _rx(
    r"(?i)\b(connection|request|read|gateway|upstream) (timed out|timeout)\b",
    r"(?i)\b(host|server) (did not|didn'?t) respond\b",
    r"(?i)\b(service|temporarily) unavailable\b|\bbad gateway\b|\bgateway timeout\b",
    r"(?i)\"?status(_code)?\"?\s*[:=]\s*(502|503|504)\b|\bhttp(/[\d.]+)? (502|503|504)\b",
    r"(?i)\b(retry|try again) later\b|\bupstream (provider|server|service) (is )?down\b",
)

_FENCE = re.compile(r"```.*?(```|$)", re.DOTALL)
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_STOP = set(
    "a an the to of in on for and or is are was be it it's this that that's with as at by me my i i'm "
    "you your please can could would will do does how what what's why which who when where pls".split()
)
# "another joke", "the next step": asking for a new item is not asking again
_NEW_ITEM = re.compile(r"\b(another|next|new|more|also|different|other|else|too|now|then)\b")
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
# Lead-ins stripped from a correction. "No", "wrong", "ok"... only when punctuation ends them:
# in "No bold please" or "Wrong language, I asked for Italian" the word is the instruction.
_LEAD_IN = re.compile(
    r"^\s*(((no|nope|nah|wrong|incorrect|not quite|not really|not exactly|sorry|ok|okay|meh)\s*[,.!:;—–-]"
    r"|(hmm+|ugh+|um+|uh+|well|actually|oh|but|and|so)\b"
    r"|(thanks|thank you|great|nice|perfect|cool|looks good)[\s,.!]*but\b)"
    r"[\s,.!:;—–-]*)+",
    re.IGNORECASE,
)
_FILLER = re.compile(r"^\W*(thanks|thank you|thx|ok|okay|hmm+|ugh+|please|pls|sorry|no|nope|wrong)?\W*$", re.I)
_TRACEBACK = re.compile(r"traceback \(most recent call last\)|^\s*[\w.]*(?:error|exception)\s*:", re.I | re.M)


# Hints the teacher can follow (METHOD §3): a correction's request, restated as an instruction.
# Ordered rewrites of one sentence. A rewrite whose pattern leaves a verb ("could you X",
# "you forgot to X") is trusted; any other sentence counts only if it starts with a common
# imperative verb. "Could you use British spelling?" -> "Use British spelling."
_IMPERATIVE_VERBS = frozenset(
    "use make keep write give put add drop remove stop don't never always answer reply respond say spell sign "
    "end start begin lead stay be show list sort order format explain tell translate convert switch change fix "
    "include skip avoid try check call pass reformat rewrite flip correct mention cut shorten leave move split "
    "return limit focus stick go count run swap state reply work search read redo apologize apologise offer "
    "introduce address call explain describe".split()
)
# Words that may come before the verb of an imperative: "please first tell me", "just give".
_ADVERBS = frozenset("first just only also always then now".split())
_LANGUAGES = {
    "español": "Spanish",
    "espanol": "Spanish",
    "français": "French",
    "francais": "French",
    "português": "Portuguese",
    "portugues": "Portuguese",
    "deutsch": "German",
    "italiano": "Italian",
}
_LANGUAGE_ASK = re.compile(
    r"\b(?:in|en|em|auf)\s+(español|espanol|français|francais|português|portugues|deutsch|italiano"
    r"|english|spanish|french|italian|german|portuguese|dutch|japanese|chinese|russian|polish|korean|arabic"
    r"|hindi|turkish|swedish|greek)\b",
    re.I,
)
_YOU = r"^(?:but |and |so )?you(?:'ve)? "


def _lowered(text: str) -> str:
    """`text` with its first letter lowered to follow a verb, unless it starts an acronym ("UK
    spelling" must not become "uK spelling")."""
    return text if text[1:2].isupper() else text[:1].lower() + text[1:]


def _lower_first(m: re.Match) -> str:
    return _lowered(m.group(1))


_REWRITES = [  # each leaves a request that starts with a verb
    (
        re.compile(
            r"^(?:could|can|would|will|should|shouldn't|why don't) you (?:please |pls |kindly )?(?:also |maybe |now )?"
            r"(.+?)[?.!]*$",
            re.I,
        ),
        r"\1",
    ),
    (re.compile(_YOU + r"(?:forgot|need|have|ought|were supposed|are supposed) to (.+)$", re.I), r"\1"),
    (re.compile(r"^(?:but |and |so )?you're supposed to (.+)$", re.I), r"\1"),
    (re.compile(_YOU + r"(?:should|must|can) (.+)$", re.I), r"\1"),
    (re.compile(r"^(?:but |and )?i (?:asked|told) you(?: twice| already)? to (.+)$", re.I), r"\1"),
    # "you forgot the deadline" -> "Include the deadline."
    (re.compile(_YOU + r"(?:forgot|missed|left out|omitted|skipped) (.+)$", re.I), r"Include \1"),
    # "it should mention X" -> "Mention X."
    (re.compile(r"^(?:but |and )?(?:it|this|that|the \w+) (?:should|must|needs to|has to) (.+)$", re.I), r"\1"),
    # "I need the summary in Japanese" / "I asked for two lines" -> "Give ..."
    (
        re.compile(r"^(?:but |and )?i(?:'d| would)? (?:need|want|prefer|like|asked for|wanted) (?!to\b)(.+)$", re.I),
        r"Give \1",
    ),
    (re.compile(r"^(?:but |and )?i(?:'d| would)? (?:need|want|prefer|like|wanted) to (.+)$", re.I), r"\1"),
    # "more friendly", "Simpler" -> "Make it more friendly."
    (
        re.compile(r"^((?:a (?:bit|little|lot) |much |way )?(?:more|less) \w+|\w{3,}er)[.!]*$", re.I),
        lambda m: "Make it " + _lower_first(m),
    ),
    # "in grams and ml", "as a bulleted list" -> "Give it in grams and ml."
    (re.compile(r"^((?:in|as) .+)$", re.I), lambda m: "Give it " + _lower_first(m)),
    # "no comments." -> "Leave out comments."
    (re.compile(r"^no (\w+(?: \w+)?)[.!]*$", re.I), r"Leave out \1"),
    # "just the city." -> "Give just the city."
    (re.compile(r"^((?:just|only) (?:the|a|one) .+)$", re.I), lambda m: "Give " + _lower_first(m)),
]
_PLEASE_HEAD = re.compile(r"^(?:.*?(?:[,;:]|\bbut|\band)\s+)?(?:please|pls|kindly),?\s+(?=\w)", re.I)
_PLEASE_TAIL = re.compile(r",? (?:please|pls|plz|por favor)(?=[.!?]*$)|,? though(?=[.!?]*$)", re.I)
# Words that start a description, not a request ("is too long please", "the time please" is a noun)
_NOT_A_VERB = frozenset(
    "i you he she it we they my your his her our their the a an this that these those there here is are was were "
    "what how why who when where which no not too very so".split()
)
# A rewritten complaint stops where the user goes on to explain: "two lines and this is six"
_EXPLANATION = re.compile(r",? (?:and|but|because|since|otherwise|so) (?:this|it|that|you|i|is|it's)\b.*$", re.I)


def _as_instruction(sentence: str) -> str | None:
    """The sentence as an instruction, or None when it states no request."""
    text = sentence.strip()
    lang = _LANGUAGE_ASK.search(text)
    if lang and not text.lower().startswith(("how ", "what ")):
        name = lang.group(1).lower()
        return f"Answer in {_LANGUAGES.get(name, name.capitalize())}."
    stripped = _PLEASE_TAIL.sub("", _PLEASE_HEAD.sub("", text)).strip()
    polite, text = stripped != text, stripped
    rewritten = polite
    for pattern, repl in _REWRITES:
        if pattern.match(text):
            text, rewritten = pattern.sub(repl, text, count=1).strip(), True
            break
    else:
        if text.endswith("?"):  # "Do you really think...?" asks, it does not instruct
            return None
        words = _WORD.findall(text.lower())
        while len(words) > 1 and words[0] in _ADVERBS:
            words = words[1:]
        if not words:
            return None
        if words[0] not in _IMPERATIVE_VERBS:
            # after "please" the next word is usually the verb ("please tone down ...");
            # a short noun phrase asked for politely is something to use ("The time, please.")
            if not polite or words[0] in _NOT_A_VERB and len(words) > 6:
                return None
            if words[0] in _NOT_A_VERB or _PLEASE_TAIL.search(sentence):
                if words[0] in ("no", "not", "is", "are", "i", "it", "you", "we", "this", "that"):
                    return None
                text = "Use " + _lowered(text)
    text = _EXPLANATION.sub("", text).rstrip(" ,;")
    if not text:
        return None
    text = text[0].upper() + text[1:]
    # a rewritten request ends as a statement; the user's own imperative keeps its punctuation
    return text + "." if rewritten and not text.endswith((".", "!", ")", "'", '"')) else text


def _normalise(text: str) -> str:
    text = text.replace("\u2019", "'").replace("\u2018", "'").lower()
    return re.sub(r"\s+", " ", _FENCE.sub(" ", text)).strip()


def _blank(text: str, patterns: list[re.Pattern]) -> str:
    for p in patterns:
        text = p.sub(lambda m: " " * len(m.group(0)), text)
    return text


def _negated(text: str, start: int) -> bool:
    """Whether the approval word at `start` is negated within its own clause
    ("not perfect", "isn't helpful"); such an approval counts as a complaint."""
    clause = re.split(r"[.,;:!?]", text[:start])[-1]
    return any(w in _NEGATORS or w.endswith("n't") for w in clause.split()[-4:])


def _content_words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in _STOP and len(w) > 1}


def _restates(previous: str, text: str) -> bool:
    """The same request asked again (METHOD §1 re-query): most content words shared."""
    a, b = _content_words(previous), _content_words(text)
    if len(a) < 2 or len(b) < 2 or _NEW_ITEM.search(text.lower()):
        return False
    return len(a & b) / len(a | b) >= 0.6


def _ends_with_question(response: str) -> bool:
    return response.rstrip().rstrip("*_)\"'").endswith("?")


def _reservation_tail(text: str, approvals: list[re.Match]) -> str | None:
    """What follows the "but" after the first approval ("thanks, the logic works, but <tail>"),
    up to where the user moves on ("now", "next"); None without such a "but"."""
    first = min((m.start() for m in approvals), default=None)
    if first is None:
        return None
    moving_on = _MOVING_ON.search(text, first)
    but = _RESERVATION.search(text, first, moving_on.start() if moving_on else len(text))
    return None if but is None else text[but.end() : moving_on.start() if moving_on else len(text)]


@dataclass(frozen=True)
class _Cues:
    strong: bool
    weak: bool
    hold: bool
    approval: bool
    reservation: bool
    weak_after_reservation: bool = False


class RulesJudge:
    """Fast English patterns for the clear cases; None when unsure (METHOD §2: the judge
    may be rules). A change request is a correction, so it scores -1."""

    source = "rules"

    def evaluate(self, inp: JudgeInput) -> Verdict | None:
        score = self._score(inp)
        return None if score is None else Verdict(score, [], self.source)

    def correction(self, inp: JudgeInput, *, corrected: bool = False) -> str | None:
        """The user's own correction, cleaned of lead-ins ("no,", "nope", "thanks, but"),
        as a hint candidate (METHOD §3); None unless the next state is a user correction
        with something to say (longer than MIN_HINT_CHARS). `corrected`: another judge (an
        LLM's verdict, the user's thumbs) already read the turn as a correction, so where the
        rules are undecided their words are the hint all the same; words the rules read as
        approval ("Thanks, that's perfect!" before a later thumbs-down) never are."""
        if inp.next_role != "user":
            return None
        score = self._score(inp)
        if score != -1 and not (corrected and score is None):
            return None
        text = _TRACEBACK.split(inp.next_state, maxsplit=1)[0]  # a pasted error is no instruction
        text = _FENCE.sub(" ", text)
        sentences = [s.strip() for s in _SENTENCE.split(text) if s and s.strip()]
        if sentences:
            sentences[0] = _LEAD_IN.sub("", sentences[0])
        sentences = [s for s in sentences if not _FILLER.match(s)]
        if len(" ".join(sentences).strip()) <= MIN_HINT_CHARS:  # too little said to teach from
            return None
        # Where the user asked for something, the instructions they carry are the hint.
        asked = [i for i in (_as_instruction(_LEAD_IN.sub("", s)) for s in sentences) if i]
        if asked:
            return " ".join(asked[:3])
        if len(sentences) > 3:  # keep the sentences that carry the correction
            cued = [s for s in sentences if self._cues(_normalise(s), "").strong]
            sentences = (cued or sentences)[:3]
        out = " ".join(sentences).strip()
        return out[0].upper() + out[1:]

    # -- internals --

    def _score(self, inp: JudgeInput) -> int | None:
        if inp.next_role == "tool":
            text = _blank(inp.next_state, TOOL_NEUTRAL)
            if not any(p.search(text) for p in TOOL_ERROR):
                return 1
            return None if any(p.search(text) for p in TOOL_TRANSIENT) else -1
        if inp.next_role != "user" or not inp.next_state.strip():
            return None
        cues = self._cues(_normalise(inp.next_state), inp.response)
        i = _last_user_index(inp.request)
        restated = i is not None and _restates(_message_text(inp.request[i]), inp.next_state)
        if cues.strong:
            return -1
        if cues.hold:
            return None
        if cues.approval:
            # "thanks, the logic works, but please rename the variables": a change asked for after
            # the "but" is a correction; a bare reservation leaves the turn to the LLM judge
            if cues.reservation:
                return -1 if cues.weak_after_reservation else None
            return 1
        if cues.weak or restated:
            return -1
        return None

    def _cues(self, text: str, response: str) -> _Cues:
        original, text = text, _blank(text, NEUTRAL)  # NEUTRAL blanks "my mistake": _OWN_SLIP reads the original
        quoted = [m.span() for m in _QUOTED.finditer(text)]
        approvals = [m for p in APPROVAL for m in p.finditer(text) if not any(a <= m.start() < b for a, b in quoted)]
        # "not perfect", "isn't helpful": a negated approval is a complaint
        kept = [m for m in approvals if not _negated(text, m.start())]
        hold = any(p.search(text) for p in HOLD)
        tail = _reservation_tail(text, kept)
        if _NEW_SUBJECT.search(text) or _OWN_SLIP.search(original):
            # no cue in it judges the answer; an approval still does, held back by a "but"
            return _Cues(strong=False, weak=False, hold=hold, approval=bool(kept), reservation=tail is not None)
        return _Cues(
            strong=any(p.search(text) for p in STRONG) or len(kept) < len(approvals),
            weak=any(p.search(text) for p in WEAK)
            or (bool(_NO_LEAD.search(text)) and not _ends_with_question(response)),
            hold=hold,
            approval=bool(kept),
            reservation=tail is not None,
            # what follows "but" opens no message ("actually…" there is no cue) and may be the user's own plan
            weak_after_reservation=tail is not None
            and not _OWN_PLAN.search(tail)
            and any(p.search(tail) for p in WEAK if p not in WEAK_OPENINGS),
        )
