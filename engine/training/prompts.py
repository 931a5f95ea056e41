"""Prompt sources written here, so no dataset has to be downloaded.

Four template families (general topics x tasks, coding tasks, HumanEval-style
function stubs, math word problems with random numbers) and the openers that seed
the target's own user turns (``data.self_written_prompts``). Every family samples
without replacement from a product of lists, so prompts rarely repeat; ``data``
deduplicates what remains.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    text: str
    source: str  # "general" | "code" | "stub" | "math" | "self"


GENERAL_TOPICS = [
    # science
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "volcanoes", "earthquakes",
    "the immune system", "DNA replication", "evolution by natural selection", "the periodic table",
    "chemical bonds", "the speed of light", "gravity", "quantum mechanics", "the theory of relativity",
    "the Big Bang", "the solar system", "the Moon's phases", "solar eclipses", "the greenhouse effect",
    "ocean currents", "coral reefs", "rainforests", "deserts", "glaciers", "hurricanes", "tornadoes",
    "lightning", "rainbows", "magnetism", "electric circuits", "batteries", "nuclear fusion",
    "nuclear fission", "radioactivity", "the human heart", "the human brain", "sleep", "dreams",
    "bacteria", "viruses", "vaccines", "antibiotics", "cells", "mitochondria", "enzymes", "proteins",
    "the nervous system", "the digestive system", "bees and pollination", "bird migration",
    "dinosaurs", "fossils", "the food chain", "ecosystems", "biodiversity", "genetics", "stem cells",
    "the ozone layer", "acid rain", "tides", "sound waves", "friction", "Newton's laws of motion",
    "energy conservation", "entropy", "telescopes", "Mars exploration", "the International Space Station",
    "exoplanets", "comets", "meteor showers",
    # technology and computing
    "machine learning", "neural networks", "artificial intelligence", "the internet", "cloud computing",
    "cybersecurity", "passwords", "encryption", "blockchain", "databases", "operating systems",
    "compilers", "version control with git", "open source software", "smartphones", "5G networks",
    "electric cars", "self-driving cars", "3D printing", "robots", "virtual reality", "social media",
    "search engines", "computer viruses", "recursion", "sorting algorithms", "binary numbers",
    "object-oriented programming", "functional programming", "APIs", "web browsers", "HTML and CSS",
    "Python", "JavaScript", "Linux", "data privacy", "big data", "the history of computers",
    "semiconductors", "solar panels", "wind turbines", "GPS", "drones", "video games", "email",
    "spreadsheets", "regular expressions", "unit testing", "debugging", "hash tables", "linked lists",
    "binary search", "graph algorithms", "time complexity", "memory management", "multithreading",
    "containers and Docker", "microservices", "the command line",
    # history and society
    "the French Revolution", "the Roman Empire", "ancient Egypt", "the pyramids", "the Renaissance",
    "the Industrial Revolution", "World War I", "World War II", "the Cold War", "the printing press",
    "the Silk Road", "the Vikings", "the Great Wall of China", "the Olympic Games", "democracy",
    "the United Nations", "human rights", "the Magna Carta", "ancient Greece", "the Aztecs",
    "the Maya civilization", "the moon landing", "the invention of the telephone", "the history of money",
    "the abolition of slavery", "the women's suffrage movement", "the Middle Ages", "castles",
    "samurai", "the Ottoman Empire", "the history of medicine", "the history of writing",
    "elections", "taxes", "inflation", "the stock market", "supply and demand", "globalization",
    "trade", "banks", "credit cards", "cryptocurrency", "unemployment", "urbanization",
    "public transportation", "libraries", "museums", "immigration", "volunteering",
    # daily life, health and work
    "healthy eating", "exercise", "meditation", "stress management", "time management",
    "public speaking", "job interviews", "writing a resume", "saving money", "budgeting", "investing",
    "retirement planning", "buying a house", "renting an apartment", "cooking pasta", "baking bread",
    "making coffee", "tea", "vegetarian diets", "gardening", "houseplants", "composting", "recycling",
    "reducing plastic waste", "learning a new language", "studying for exams", "online learning",
    "remote work", "team meetings", "leadership", "negotiation", "customer service", "starting a business",
    "marketing", "friendship", "parenting", "pets", "dogs", "cats", "training a puppy", "first aid",
    "drinking enough water", "walking", "running a marathon", "yoga", "cycling", "swimming",
    "camping", "hiking", "travel on a budget", "packing for a trip", "jet lag", "moving to a new city",
    "cleaning the house", "minimalism", "procrastination", "motivation", "habits", "kindness",
    "gratitude", "happiness", "loneliness", "screen time", "reading more books", "journaling",
    # arts, culture, nature
    "jazz", "classical music", "learning the guitar", "the piano", "painting", "photography",
    "poetry", "Shakespeare", "fairy tales", "mythology", "Greek gods", "film making", "animation",
    "architecture", "fashion", "street art", "theater", "chess", "football", "basketball", "tennis",
    "the World Cup", "board games", "card games", "origami", "knitting", "pottery", "dance",
    "comic books", "science fiction", "detective stories", "libraries of the future", "the ocean",
    "mountains", "rivers", "forests", "autumn", "winter", "spring", "summer", "the night sky",
    "sunsets", "whales", "elephants", "octopuses", "wolves", "butterflies", "ants", "penguins",
    "owls", "sharks", "horses", "trees", "flowers", "mushrooms", "the weather", "seasons",
    "islands", "cities", "villages", "trains", "airplanes", "bicycles", "ships", "bridges",
    # ideas and math concepts
    "philosophy", "ethics", "free will", "logic", "critical thinking", "the scientific method",
    "probability", "statistics", "prime numbers", "fractions", "percentages", "geometry",
    "the Pythagorean theorem", "algebra", "calculus", "infinity", "zero", "pi", "the Fibonacci sequence",
    "game theory", "economics", "psychology", "memory", "creativity", "curiosity", "language",
    "translation", "emotions", "empathy", "decision making", "artificial sweeteners", "caffeine",
]

GENERAL_TASKS = [
    "Explain {topic} in simple terms.",
    "What is {topic}?",
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Give me three interesting facts about {topic}.",
    "Summarize the key ideas of {topic} in one paragraph.",
    "List five things everyone should know about {topic}.",
    "Write a short story that involves {topic}.",
    "Compare {topic} and {other}.",
    "What do {topic} and {other} have in common?",
    "What are the pros and cons of {topic}?",
    "How would you explain {topic} to a ten-year-old?",
    "Write an email to a friend about {topic}.",
    "Write the introduction of a blog post about {topic}.",
    "Give step-by-step instructions for getting started with {topic}.",
    "What are common misconceptions about {topic}?",
    "Create a quiz with three questions about {topic}, with answers.",
    "Why is {topic} important?",
    "Describe the history of {topic}.",
    "Write a tweet about {topic}.",
    "Write a limerick about {topic}.",
    "What questions should I ask an expert on {topic}?",
    "Make a one-week study plan to understand {topic}.",
    "Write a dialogue between a teacher and a student about {topic}.",
    "Summarize {topic} in one sentence.",
    "Write a persuasive paragraph about {topic}.",
    "Describe {topic} using an analogy.",
    "What are the main challenges related to {topic}?",
    "Tell me a fun fact about {topic}.",
    "Outline an essay on {topic}.",
    "Write a short speech about {topic}.",
    "What careers are related to {topic}?",
    "How does {topic} affect everyday life?",
    "Give me a brief timeline of {topic}.",
    "Write a riddle about {topic}.",
    "Define {topic} and give an example.",
    "How has {topic} changed over the last hundred years?",
    "What would the world be like without {topic}?",
    "Write a product description inspired by {topic}.",
    "Give me a list of books or resources to learn about {topic}.",
    "What is a good way to remember facts about {topic}?",
    "Write a formal letter to a newspaper about {topic}.",
]

GENERAL_STYLES = ["", " Keep it brief.", " Use bullet points.", " Write for a high school student.",
                  " Use about 100 words.", " Be specific."]

CODE_TASKS = [
    "reverse a string", "check whether a number is prime", "compute the factorial of n",
    "find the largest element in a list", "merge two sorted lists", "count the vowels in a string",
    "remove duplicates from a list while keeping the order", "check if a string is a palindrome",
    "compute the nth Fibonacci number", "sort a list of dictionaries by a key",
    "read a CSV file and print each row", "flatten a nested list", "find the second largest number in a list",
    "convert Celsius to Fahrenheit", "compute the greatest common divisor of two numbers",
    "do a binary search in a sorted list", "count word frequencies in a text",
    "validate an email address with a regular expression", "transpose a matrix", "implement a stack class",
    "implement a queue using two stacks", "group anagrams from a list of words",
    "compute the sum of the digits of an integer", "check if two strings are anagrams",
    "generate all permutations of a list", "find the longest common prefix of a list of strings",
    "rotate a list by k positions", "implement bubble sort", "implement quicksort", "implement merge sort",
    "compute the mean, median and mode of a list", "convert a decimal number to binary",
    "parse a JSON string and print one of its fields", "find the intersection of two lists",
    "check if a year is a leap year", "capitalize the first letter of each word",
    "compute the power set of a set", "find the missing number in a list containing 1 to n",
    "count the number of lines in a file", "implement a singly linked list", "reverse a linked list",
    "detect a cycle in a linked list", "compute the depth of a binary tree",
    "do a breadth-first search on a graph", "do a depth-first search on a graph",
    "find shortest paths with Dijkstra's algorithm", "compute the edit distance between two strings",
    "find the longest increasing subsequence", "solve the two-sum problem",
    "compute a running average of a stream of numbers", "split a list into chunks of size n",
    "remove all whitespace from a string", "count the occurrences of each character in a string",
    "find the most common element in a list", "check whether parentheses are balanced",
    "evaluate a postfix expression", "convert Roman numerals to integers", "convert integers to Roman numerals",
    "find all primes up to n with the sieve of Eratosthenes", "compute the dot product of two vectors",
    "multiply two matrices", "shuffle a list", "write a list of lines to a text file",
    "sort a dictionary by its values", "invert a dictionary", "merge two dictionaries",
    "compute compound interest", "format a number with thousands separators",
    "check the strength of a password", "generate a random password", "compute the area of a circle",
    "find all factors of a number", "check if a number is a perfect square",
    "compute the least common multiple of two numbers", "find the duplicates in a list",
    "compute the cumulative sum of a list", "build a dictionary from two lists",
    "implement a simple calculator", "count the words in a sentence", "truncate a string to n characters",
    "compute the Hamming distance between two strings", "check if a list is sorted",
    "find the kth smallest element of a list", "compute a moving average",
    "group words by their first letter", "implement a binary search tree with insert and search",
    "compute the Collatz sequence of a number", "filter the even numbers from a list",
    "square every number in a list", "find the longest word in a sentence",
    "strip punctuation from a string", "reverse the order of words in a sentence",
    "count the set bits of an integer", "compute the distance between two points",
    "implement an LRU cache", "memoize a recursive function", "measure how long a function takes",
    "retry a function call when it fails", "parse command-line arguments",
    "count the unique words in a text file", "write a class for a bank account",
    "solve the Tower of Hanoi", "solve the N-Queens problem", "print Pascal's triangle",
    "check if a number is an Armstrong number", "convert hours and minutes to seconds",
    "find the median of two sorted lists", "compute the maximum subarray sum",
    "count the islands in a grid of 0s and 1s", "rotate a matrix by 90 degrees",
    "traverse a matrix in spiral order", "implement a min-heap", "merge overlapping intervals",
    "find the majority element of a list", "count the ways to climb n stairs taking 1 or 2 steps",
    "solve the 0/1 knapsack problem", "compress a string with run-length encoding",
    "implement a Caesar cipher", "check if a sentence is a pangram",
    "find the first non-repeating character in a string", "sum all numbers in a nested list",
    "generate the first n prime numbers", "compute a square root with Newton's method",
    "convert a string to snake_case", "convert snake_case to camelCase", "validate a Sudoku board",
    "find the longest palindromic substring", "count the vowels and consonants in a string",
    "find the GCD of a list of numbers", "check whether a string is a valid IPv4 address",
    "compute the day of the week for a date", "convert a string of digits to an integer without int()",
    "implement matrix addition", "find pairs in a list that sum to a target",
    "remove the vowels from a string", "compute the average word length of a sentence",
    "print a multiplication table", "simulate rolling two dice", "find the nearest number to a target in a list",
]

CODE_TEMPLATES = [
    "Write a Python function to {task}.",
    "How do I {task} in Python?",
    "Write a Python program to {task}.",
    "Show me how to {task} in JavaScript.",
    "Write a C function to {task}.",
    "Write Java code to {task}.",
    "Implement a function that can {task}. Use Python and explain the code.",
    "Write a short Python script to {task} and show an example run.",
    "What is an efficient way to {task}? Show code.",
    "Write a Python function with a docstring to {task}.",
    "Write a C++ function to {task}.",
    "Write unit tests for a function that should {task}.",
    "Explain an algorithm to {task}, then implement it in Python.",
    "Write a Rust function to {task}.",
    "I need to {task}. Can you write the code?",
]

CODE_MODIFIERS = ["", " Use type hints.", " Make it efficient.", " Add comments explaining each step.",
                  " Include a few test cases.", " Handle edge cases.", " Keep it short.",
                  " Do not use any libraries."]

# HumanEval-style stubs: (imports, signature, description, [(call, result), ...]).
FUNCTION_SPECS = [
    ("from typing import List\n\n\n", "def below_zero(operations: List[int]) -> bool:",
     "You're given a list of deposit and withdrawal operations on a bank account that starts with\n"
     "zero balance. Return True if at any point the balance falls below zero, otherwise False.",
     [("below_zero([1, 2, 3])", "False"), ("below_zero([1, 2, -4, 5])", "True")]),
    ("from typing import List\n\n\n", "def mean_absolute_deviation(numbers: List[float]) -> float:",
     "Return the mean absolute deviation of the numbers around their mean.",
     [("mean_absolute_deviation([1.0, 2.0, 3.0, 4.0])", "1.0")]),
    ("", "def truncate_number(number: float) -> float:",
     "Given a positive floating point number, return its decimal part.",
     [("truncate_number(3.5)", "0.5")]),
    ("from typing import List\n\n\n", "def filter_by_prefix(strings: List[str], prefix: str) -> List[str]:",
     "Filter an input list of strings only for ones that start with a given prefix.",
     [("filter_by_prefix([], 'a')", "[]"), ("filter_by_prefix(['abc', 'bcd', 'array'], 'a')", "['abc', 'array']")]),
    ("", "def count_distinct_characters(string: str) -> int:",
     "Given a string, find out how many distinct characters (regardless of case) it consists of.",
     [("count_distinct_characters('xyzXYZ')", "3"), ("count_distinct_characters('Jerry')", "4")]),
    ("", "def is_palindrome(text: str) -> bool:",
     "Checks if the given string is a palindrome.",
     [("is_palindrome('')", "True"), ("is_palindrome('aba')", "True"), ("is_palindrome('zbcd')", "False")]),
    ("", "def greatest_common_divisor(a: int, b: int) -> int:",
     "Return the greatest common divisor of two integers a and b.",
     [("greatest_common_divisor(3, 5)", "1"), ("greatest_common_divisor(25, 15)", "5")]),
    ("from typing import List\n\n\n", "def all_prefixes(string: str) -> List[str]:",
     "Return a list of all prefixes of the input string, from shortest to longest.",
     [("all_prefixes('abc')", "['a', 'ab', 'abc']")]),
    ("", "def string_sequence(n: int) -> str:",
     "Return a string containing space-delimited numbers starting from 0 up to n inclusive.",
     [("string_sequence(0)", "'0'"), ("string_sequence(5)", "'0 1 2 3 4 5'")]),
    ("from typing import List\n\n\n", "def remove_duplicates(numbers: List[int]) -> List[int]:",
     "From a list of integers, remove all elements that occur more than once.\n"
     "Keep the order of the remaining elements the same as in the input.",
     [("remove_duplicates([1, 2, 3, 2, 4])", "[1, 3, 4]")]),
    ("", "def flip_case(string: str) -> str:",
     "For a given string, flip lowercase characters to uppercase and uppercase to lowercase.",
     [("flip_case('Hello')", "'hELLO'")]),
    ("from typing import List\n\n\n", "def concatenate(strings: List[str]) -> str:",
     "Concatenate a list of strings into a single string.",
     [("concatenate([])", "''"), ("concatenate(['a', 'b', 'c'])", "'abc'")]),
    ("", "def get_positive(l: list):",
     "Return only the positive numbers in the list.",
     [("get_positive([-1, 2, -4, 5, 6])", "[2, 5, 6]")]),
    ("", "def is_prime(n: int) -> bool:",
     "Return True if a given number is prime, and False otherwise.",
     [("is_prime(6)", "False"), ("is_prime(101)", "True"), ("is_prime(1)", "False")]),
    ("", "def unique(l: list):",
     "Return the sorted unique elements of a list.",
     [("unique([5, 3, 5, 2, 3, 3, 9, 0, 123])", "[0, 2, 3, 5, 9, 123]")]),
    ("", "def max_element(l: list):",
     "Return the maximum element in the list.",
     [("max_element([1, 2, 3])", "3"), ("max_element([5, 3, -5, 2, -3, 3, 9, 0, 123, 1, -10])", "123")]),
    ("", "def fizz_buzz(n: int) -> int:",
     "Return the number of times the digit 7 appears in integers less than n which are divisible by 11 or 13.",
     [("fizz_buzz(50)", "0"), ("fizz_buzz(78)", "2")]),
    ("", "def sum_to_n(n: int) -> int:",
     "sum_to_n is a function that sums numbers from 1 to n.",
     [("sum_to_n(5)", "15"), ("sum_to_n(10)", "55"), ("sum_to_n(1)", "1")]),
    ("", "def correct_bracketing(brackets: str) -> bool:",
     "brackets is a string of '(' and ')'.\nReturn True if every opening bracket has a corresponding closing bracket.",
     [("correct_bracketing('(')", "False"), ("correct_bracketing('(()())')", "True"),
      ("correct_bracketing(')(()')", "False")]),
    ("", "def fib(n: int) -> int:",
     "Return the n-th Fibonacci number.",
     [("fib(10)", "55"), ("fib(1)", "1"), ("fib(8)", "21")]),
    ("", "def vowels_count(s: str) -> int:",
     "Write a function which takes a string representing a word as input and returns the number of vowels\n"
     "in the string. Vowels are 'a', 'e', 'i', 'o', 'u'.",
     [("vowels_count('abcde')", "2")]),
    ("", "def digit_sum(s: str) -> int:",
     "Write a function that takes a string as input and returns the sum of the ASCII codes of its\n"
     "upper case characters only.",
     [("digit_sum('')", "0"), ("digit_sum('abAB')", "131")]),
    ("", "def largest_divisor(n: int) -> int:",
     "For a given number n, find the largest number that divides n evenly, smaller than n.",
     [("largest_divisor(15)", "5")]),
    ("from typing import List\n\n\n", "def factorize(n: int) -> List[int]:",
     "Return the list of prime factors of a given integer in order from smallest to largest.\n"
     "Each factor is listed the number of times it appears in the factorization.",
     [("factorize(8)", "[2, 2, 2]"), ("factorize(70)", "[2, 5, 7]")]),
    ("", "def strlen(string: str) -> int:",
     "Return the length of the given string.",
     [("strlen('')", "0"), ("strlen('abc')", "3")]),
    ("from typing import List\n\n\n", "def rescale_to_unit(numbers: List[float]) -> List[float]:",
     "Given a list of at least two numbers, apply a linear transform so that the smallest number\n"
     "becomes 0 and the largest becomes 1.",
     [("rescale_to_unit([1.0, 2.0, 3.0, 4.0, 5.0])", "[0.0, 0.25, 0.5, 0.75, 1.0]")]),
    ("from typing import List, Tuple\n\n\n", "def sum_product(numbers: List[int]) -> Tuple[int, int]:",
     "For a given list of integers, return a tuple of the sum and the product of all the integers.\n"
     "An empty sum is 0 and an empty product is 1.",
     [("sum_product([])", "(0, 1)"), ("sum_product([1, 2, 3, 4])", "(10, 24)")]),
    ("from typing import List\n\n\n", "def rolling_max(numbers: List[int]) -> List[int]:",
     "From a given list of integers, generate a list of the rolling maximum element found until\n"
     "the given moment in the sequence.",
     [("rolling_max([1, 2, 3, 2, 3, 4, 2])", "[1, 2, 3, 3, 3, 4, 4]")]),
    ("from typing import List\n\n\n", "def intersperse(numbers: List[int], delimeter: int) -> List[int]:",
     "Insert a number 'delimeter' between every two consecutive elements of the input list.",
     [("intersperse([], 4)", "[]"), ("intersperse([1, 2, 3], 4)", "[1, 4, 2, 4, 3]")]),
    ("from typing import List, Optional\n\n\n", "def longest(strings: List[str]) -> Optional[str]:",
     "Out of a list of strings, return the longest one. Return the first one in case of multiple\n"
     "strings of the same length. Return None if the input list is empty.",
     [("longest([])", "None"), ("longest(['a', 'bb', 'ccc'])", "'ccc'")]),
    ("", "def how_many_times(string: str, substring: str) -> int:",
     "Find how many times a given substring can be found in the original string. Count overlapping cases.",
     [("how_many_times('aaa', 'a')", "3"), ("how_many_times('aaaa', 'aa')", "3")]),
    ("from typing import List\n\n\n", "def sort_numbers(numbers: str) -> str:",
     "Input is a space-delimited string of numerals from 'zero' to 'nine'.\n"
     "Return the string with numbers sorted from smallest to largest.",
     [("sort_numbers('three one five')", "'one three five'")]),
    ("from typing import List, Tuple\n\n\n", "def find_closest_elements(numbers: List[float]) -> Tuple[float, float]:",
     "From a list of numbers (of length at least two), select and return the two that are closest to\n"
     "each other, in order (smaller number, larger number).",
     [("find_closest_elements([1.0, 2.0, 3.0, 4.0, 5.0, 2.2])", "(2.0, 2.2)")]),
    ("", "def change_base(x: int, base: int) -> str:",
     "Change the numerical base of input number x to base and return the string representation.\n"
     "Base numbers are less than 10.",
     [("change_base(8, 3)", "'22'"), ("change_base(8, 2)", "'1000'")]),
    ("", "def triangle_area(a: float, h: float) -> float:",
     "Given the length of a side and the height, return the area of a triangle.",
     [("triangle_area(5, 3)", "7.5")]),
    ("", "def median(l: list):",
     "Return the median of the elements in the list l.",
     [("median([3, 1, 2, 4, 5])", "3")]),
    ("", "def modp(n: int, p: int) -> int:",
     "Return 2^n modulo p (be aware of numerics).",
     [("modp(3, 5)", "3"), ("modp(0, 101)", "1")]),
    ("", "def remove_vowels(text: str) -> str:",
     "remove_vowels is a function that takes a string and returns the string without vowels.",
     [("remove_vowels('abcdef')", "'bcdf'"), ("remove_vowels('aaBAA')", "'B'")]),
    ("", "def below_threshold(l: list, t: int) -> bool:",
     "Return True if all numbers in the list l are below threshold t.",
     [("below_threshold([1, 2, 4, 10], 100)", "True"), ("below_threshold([1, 20, 4, 10], 5)", "False")]),
    ("", "def same_chars(s0: str, s1: str) -> bool:",
     "Check if two words have the same characters.",
     [("same_chars('abcd', 'dddddddabc')", "True"), ("same_chars('abcd', 'dddddddabce')", "False")]),
    ("", "def monotonic(l: list) -> bool:",
     "Return True if the list elements are monotonically increasing or decreasing.",
     [("monotonic([1, 2, 4, 20])", "True"), ("monotonic([1, 20, 4, 10])", "False")]),
    ("", "def common(l1: list, l2: list) -> list:",
     "Return the sorted unique common elements of two lists.",
     [("common([5, 3, 2, 8], [3, 2])", "[2, 3]")]),
    ("", "def derivative(xs: list) -> list:",
     "xs are the coefficients of a polynomial: xs[0] + xs[1] * x + xs[2] * x^2 + ...\n"
     "Return the derivative of this polynomial in the same form.",
     [("derivative([3, 1, 2, 4, 5])", "[1, 4, 12, 20]"), ("derivative([1, 2, 3])", "[2, 6]")]),
    ("", "def circular_shift(x: int, shift: int) -> str:",
     "Circular shift the digits of the integer x right by shift and return the result as a string.\n"
     "If shift is greater than the number of digits, return the digits reversed.",
     [("circular_shift(12, 1)", "'21'"), ("circular_shift(12, 2)", "'12'")]),
    ("", "def count_upper(s: str) -> int:",
     "Given a string s, count the number of uppercase vowels in even indices.",
     [("count_upper('aBCdEf')", "1"), ("count_upper('abcdefg')", "0")]),
    ("", "def closest_integer(value: str) -> int:",
     "Create a function that takes a value (string) representing a number and returns the closest\n"
     "integer to it. If the number is equidistant from two integers, round it away from zero.",
     [("closest_integer('10')", "10"), ("closest_integer('15.3')", "15")]),
    ("", "def words_string(s: str) -> list:",
     "You will be given a string of words separated by commas or spaces. Split the string into\n"
     "words and return a list of the words.",
     [("words_string('Hi, my name is John')", "['Hi', 'my', 'name', 'is', 'John']")]),
    ("", "def choose_num(x: int, y: int) -> int:",
     "This function takes two positive numbers x and y and returns the biggest even integer number\n"
     "in the range [x, y] inclusive. If there is no such number, return -1.",
     [("choose_num(12, 15)", "14"), ("choose_num(13, 12)", "-1")]),
    ("", "def add(x: int, y: int) -> int:",
     "Add two numbers x and y.",
     [("add(2, 3)", "5"), ("add(5, 7)", "12")]),
    ("", "def encrypt(s: str) -> str:",
     "Create a function that takes a string and returns it encrypted with the alphabet rotated so\n"
     "that each letter shifts down by four places.",
     [("encrypt('hi')", "'lm'"), ("encrypt('et')", "'ix'")]),
    ("", "def next_smallest(lst: list):",
     "You are given a list of integers. Return the second smallest element of the list,\n"
     "or None if there is no such element.",
     [("next_smallest([1, 2, 3, 4, 5])", "2"), ("next_smallest([])", "None"), ("next_smallest([1, 1])", "None")]),
    ("", "def any_int(x, y, z) -> bool:",
     "Create a function that takes 3 numbers. Returns True if one of the numbers is equal to the sum\n"
     "of the other two, and all numbers are integers. Returns False in any other case.",
     [("any_int(5, 2, 7)", "True"), ("any_int(3, 2, 2)", "False")]),
    ("", "def is_nested(string: str) -> bool:",
     "Create a function that takes a string containing only square brackets and returns True if\n"
     "there is a valid subsequence of brackets where at least one bracket is nested.",
     [("is_nested('[[]]')", "True"), ("is_nested('[]]]]]]][[[[[]')", "False")]),
    ("", "def sum_squares(lst: list) -> int:",
     "You are given a list of numbers. Return the sum of the squared numbers in the list,\n"
     "rounding each element up to the next integer first.",
     [("sum_squares([1, 2, 3])", "14"), ("sum_squares([1.4, 4.2, 0])", "29")]),
    ("", "def check_if_last_char_is_a_letter(txt: str) -> bool:",
     "Return True if the last character of a given string is an alphabetical character and is not\n"
     "a part of a word, and False otherwise.",
     [("check_if_last_char_is_a_letter('apple pie')", "False"),
      ("check_if_last_char_is_a_letter('apple pi e')", "True")]),
    ("", "def largest_smallest_integers(lst: list) -> tuple:",
     "Return a tuple (a, b), where a is the largest negative integer and b is the smallest positive\n"
     "integer in the list. If there are no negative or positive integers, return None for them.",
     [("largest_smallest_integers([2, 4, 1, 3, 5, 7])", "(None, 1)"),
      ("largest_smallest_integers([])", "(None, None)")]),
    ("", "def special_factorial(n: int) -> int:",
     "The Brazilian factorial is defined as n! * (n-1)! * (n-2)! * ... * 1!, where n > 0.\n"
     "Return the Brazilian factorial of n.",
     [("special_factorial(4)", "288")]),
    ("", "def fix_spaces(text: str) -> str:",
     "Given a string text, replace all spaces in it with underscores, and if a string has more than\n"
     "2 consecutive spaces, then replace all consecutive spaces with '-'.",
     [("fix_spaces('Example')", "'Example'"), ("fix_spaces('Example 1')", "'Example_1'")]),
    ("", "def x_or_y(n: int, x, y):",
     "A simple program which should return the value of x if n is a prime number and should\n"
     "return the value of y otherwise.",
     [("x_or_y(7, 34, 12)", "34"), ("x_or_y(15, 8, 5)", "5")]),
    ("", "def even_odd_count(num: int) -> tuple:",
     "Given an integer, return a tuple that has the number of even and odd digits respectively.",
     [("even_odd_count(-12)", "(1, 1)"), ("even_odd_count(123)", "(1, 2)")]),
    ("", "def right_angle_triangle(a: float, b: float, c: float) -> bool:",
     "Given the lengths of the three sides of a triangle, return True if the three sides form a\n"
     "right-angled triangle, False otherwise.",
     [("right_angle_triangle(3, 4, 5)", "True"), ("right_angle_triangle(1, 2, 3)", "False")]),
    ("", "def find_max(words: list) -> str:",
     "Write a function that accepts a list of strings and returns the word with the maximum number\n"
     "of unique characters. If several words have it, return the first in lexicographical order.",
     [("find_max(['name', 'of', 'string'])", "'string'"), ("find_max(['name', 'enam', 'game'])", "'enam'")]),
    ("", "def string_to_md5(text: str):",
     "Given a string text, return its md5 hash equivalent string. If text is an empty string, return None.",
     []),
    ("", "def generate_integers(a: int, b: int) -> list:",
     "Given two positive integers a and b, return the even digits between a and b, in ascending order.",
     [("generate_integers(2, 8)", "[2, 4, 6, 8]"), ("generate_integers(8, 2)", "[2, 4, 6, 8]")]),
    ("from typing import List\n\n\n", "def below_average(numbers: List[float]) -> List[float]:",
     "Return the numbers that are strictly below the average of the list, in their original order.",
     [("below_average([1.0, 2.0, 3.0, 4.0])", "[1.0, 2.0]")]),
    ("", "def count_words(sentence: str) -> int:",
     "Return the number of words in the sentence. Words are separated by one or more spaces.",
     [("count_words('hello world')", "2"), ("count_words('  a  b c ')", "3")]),
    ("", "def celsius_to_fahrenheit(c: float) -> float:",
     "Convert a temperature from degrees Celsius to degrees Fahrenheit.",
     [("celsius_to_fahrenheit(0)", "32.0"), ("celsius_to_fahrenheit(100)", "212.0")]),
    ("from typing import Dict, List\n\n\n", "def char_frequency(text: str) -> Dict[str, int]:",
     "Return a dictionary mapping each character of text to the number of times it occurs.",
     [("char_frequency('abca')", "{'a': 2, 'b': 1, 'c': 1}")]),
    ("from typing import List\n\n\n", "def running_sum(numbers: List[int]) -> List[int]:",
     "Return the list of running sums: the i-th element is the sum of numbers[0..i].",
     [("running_sum([1, 2, 3, 4])", "[1, 3, 6, 10]")]),
    ("", "def is_leap_year(year: int) -> bool:",
     "Return True if year is a leap year in the Gregorian calendar.",
     [("is_leap_year(2000)", "True"), ("is_leap_year(1900)", "False"), ("is_leap_year(2024)", "True")]),
    ("from typing import List\n\n\n", "def second_largest(numbers: List[int]) -> int:",
     "Return the second largest distinct value in the list. The list has at least two distinct values.",
     [("second_largest([4, 1, 3, 4])", "3")]),
    ("", "def reverse_words(sentence: str) -> str:",
     "Return the sentence with the order of its words reversed.",
     [("reverse_words('the quick fox')", "'fox quick the'")]),
    ("from typing import List\n\n\n", "def chunk(items: List[int], size: int) -> List[List[int]]:",
     "Split items into consecutive chunks of the given size; the last chunk may be shorter.",
     [("chunk([1, 2, 3, 4, 5], 2)", "[[1, 2], [3, 4], [5]]")]),
    ("", "def to_binary(n: int) -> str:",
     "Return the binary representation of a non-negative integer n, without the '0b' prefix.",
     [("to_binary(0)", "'0'"), ("to_binary(10)", "'1010'")]),
]

STUB_FRAMINGS = [
    "{stub}",
    "Complete the following Python function:\n\n```python\n{stub}```",
    "Complete this Python code.\n\n{stub}",
    "Implement the function below.\n\n```python\n{stub}```",
    "Write the body of this function:\n{stub}",
    "Finish the implementation and explain it briefly:\n```python\n{stub}```",
    "{stub}\n# Complete the function above.",
]

NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kate", "Liam",
         "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yuki", "Zoe"]
ITEMS = ["apples", "books", "marbles", "pencils", "stickers", "cookies", "cards", "coins", "flowers", "toy cars",
         "eggs", "oranges", "stamps", "shells", "candies"]

# Starts of user turns that the target finishes itself (data.self_written_prompts).
TOPIC_OPENERS = [
    "Tell me about {topic}", "I'm curious about {topic}.", "Can you help me with {topic}?",
    "I have a question about {topic}:", "Explain {topic}", "Write something about {topic}",
    "My teacher asked us about {topic}.", "What's the deal with {topic}?", "I'm writing an essay on {topic}.",
    "Quick question on {topic}:", "I want to learn about {topic}.", "How does {topic}", "Why is {topic}",
    "Give me ideas related to {topic}", "As a beginner in {topic},",
]
TASK_OPENERS = ["How do I {task}", "Write code to {task}", "I'm trying to {task}", "In Python, how can I {task}",
                "Write a program that can {task}", "What's the fastest way to {task}"]
OPEN_OPENERS = [
    "Write a Python", "Write a function", "How do I", "What is", "Can you write", "Explain how", "Why do",
    "Write a poem", "Write a story", "Solve", "Help me", "I need", "Give me", "List", "Summarize",
    "Compare", "What are", "How can I", "Create a", "Translate", "Describe", "Can you explain", "Is it true that",
    "Write an email", "Calculate", "",
]


def _sample_product(sizes: list[int], count: int, rng: random.Random) -> list[tuple[int, ...]]:
    """``count`` distinct index tuples from the product of ``sizes`` (all of them if fewer)."""
    total = 1
    for size in sizes:
        total *= size
    picks = rng.sample(range(total), min(count, total))
    tuples = []
    for flat in picks:
        digits = []
        for size in reversed(sizes):
            flat, digit = divmod(flat, size)
            digits.append(digit)
        tuples.append(tuple(reversed(digits)))
    return tuples


def general_prompts(count: int, rng: random.Random) -> list[Prompt]:
    sizes = [len(GENERAL_TOPICS), len(GENERAL_TASKS), len(GENERAL_STYLES)]
    prompts = []
    for topic, task, style in _sample_product(sizes, count, rng):
        # topics are listed by field, so a near neighbour makes a sensible comparison
        other = GENERAL_TOPICS[(topic + rng.randint(1, 6)) % len(GENERAL_TOPICS)]
        text = GENERAL_TASKS[task].format(topic=GENERAL_TOPICS[topic], other=other) + GENERAL_STYLES[style]
        prompts.append(Prompt(text[0].upper() + text[1:], "general"))
    return prompts


def code_prompts(count: int, rng: random.Random) -> list[Prompt]:
    sizes = [len(CODE_TASKS), len(CODE_TEMPLATES), len(CODE_MODIFIERS)]
    return [Prompt(CODE_TEMPLATES[template].format(task=CODE_TASKS[task]) + CODE_MODIFIERS[modifier], "code")
            for task, template, modifier in _sample_product(sizes, count, rng)]


def render_stub(imports: str, signature: str, description: str, examples: list[tuple[str, str]]) -> str:
    """A function stub the way HumanEval presents one: signature, docstring, doctest examples."""
    lines = [f"    {line}" if line else "" for line in description.split("\n")]
    for call, result in examples:
        lines += [f"    >>> {call}", f"    {result}"]
    body = "\n".join(lines).removeprefix("    ")
    return f'{imports}{signature}\n    """ {body}\n    """\n'


def stub_prompts() -> list[Prompt]:
    """Every spec under every framing (a few hundred prompts): the HumanEval prompt shape."""
    stubs = [render_stub(*spec) for spec in FUNCTION_SPECS]
    return [Prompt(framing.format(stub=stub), "stub") for stub in stubs for framing in STUB_FRAMINGS]


def _math_problem(rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(1, 20)
    p, n = rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 75]), rng.randint(20, 900)
    templates = [
        f"{name} has {a + c} {item}. {name} buys {b} more and gives {c} away. How many {item} are left?",
        f"A train travels at {a + 30} km/h for {c} hours. How far does it travel?",
        f"What is {a} times {b}?",
        f"Compute {a} + {b} * {c}.",
        f"Solve for x: {c}x + {b} = {c * a + b}.",
        f"What is {p}% of {n}?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"A shirt costs ${a + 10} and is on sale for {p}% off. What is the sale price?",
        f"{name} reads {c + 5} pages a day. How many days will it take to finish a {n}-page book?",
        f"Find the average of {a}, {b}, {c} and {a + b}.",
        f"What is the least common multiple of {a} and {b}?",
        f"Simplify the fraction {a * c}/{b * c}.",
        f"Convert {n} minutes to hours and minutes.",
        f"A recipe needs {c + 1} cups of flour for {b} cookies. How much flour is needed for {b * 3} cookies?",
        f"What is the square root of {a * a}?",
        f"Is {n} a prime number? Explain why.",
        f"Solve the system of equations: x + y = {a + b}, x - y = {a - b}.",
        f"{name} saves ${c + 4} every week. How much will {name} have saved after {b} weeks?",
        f"The sum of two numbers is {a + b} and their difference is {abs(a - b)}. What are the numbers?",
        f"A car uses {c % 9 + 4} liters of fuel per 100 km. How much fuel does it need for {n} km?",
        f"What is {n} divided by {c + 1}, with remainder?",
        f"Find the derivative of {a}x^{c % 5 + 2} + {b}x.",
        f"What is the probability of rolling a sum of {c % 11 + 2} with two fair dice?",
        f"How many seconds are there in {c} hours?",
        f"A class has {a + 10} students and {p}% of them are girls. How many boys are there?",
        f"Evaluate {a}^2 - {b}^2.",
        f"Calculate the simple interest on ${n * 10} at {c % 9 + 1}% per year for {b % 10 + 1} years.",
        f"{name} is {c + 5} years old and {name}'s mother is {a % 3 + 2} times as old. "
        f"How old will the mother be in {b} years?",
        f"{name} has {a} {item} and shares them equally among {c % 6 + 2} friends. "
        f"How many does each friend get, and how many are left over?",
        f"A tank holds {n} liters and fills at {c + 2} liters per minute. How long does it take to fill?",
        f"If {c + 2} workers build a wall in {b} days, how long would {c + 4} workers take?",
        f"What is the perimeter of a square with an area of {a * a} square meters?",
        f"A bag has {a} red balls and {b} blue balls. What is the probability of drawing a red ball?",
        f"Round {n}.{a} to the nearest ten.",
        f"Write {n} in Roman numerals.",
    ]
    framing = rng.choice(["", " Show your work.", " Explain step by step.", " Give a short answer."])
    return rng.choice(templates) + framing


def math_prompts(count: int, rng: random.Random) -> list[Prompt]:
    return [Prompt(_math_problem(rng), "math") for _ in range(count)]


def self_written_openers(count: int, rng: random.Random) -> list[str]:
    """Starts of user turns for the target to finish: 40% name a topic, 20% a coding task, 40% are open."""
    openers = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.4:
            openers.append(rng.choice(TOPIC_OPENERS).format(topic=rng.choice(GENERAL_TOPICS)))
        elif roll < 0.6:
            openers.append(rng.choice(TASK_OPENERS).format(task=rng.choice(CODE_TASKS)))
        else:
            openers.append(rng.choice(OPEN_OPENERS))
    return openers
